"""Tool calling at ``/v1/chat/completions`` (vLLM's behaviour): the checks on ``tools`` and
``tool_choice``, what each choice does to a request, and the calls in its response.

=================  ==========================  ================================================
``tool_choice``    the output                  the response
=================  ==========================  ================================================
``none``           free text                   ``content``
``auto``           free text                   the ``--tool-call-parser`` splits it into
                                               ``content`` and ``tool_calls``
``required``       guided: a JSON array of     ``tool_calls``
                   ``{"name", "parameters"}``
named function     guided: its ``parameters``  one call of it
=================  ==========================  ================================================

The tools reach the chat template (``tools=``), except with ``tool_choice="none"`` under
``--exclude-tools-when-tool-choice-none``. Without ``tool_choice``, tools mean
``auto``, which needs ``pagelm serve --enable-auto-tool-choice --tool-call-parser NAME``.
``finish_reason`` is ``tool_calls`` when ``auto`` or ``required`` called a tool and the
output ended by itself; a named choice ends with ``stop``, as OpenAI's does.
``parallel_tool_calls=false`` allows one call: ``required`` decodes an array of one, ``auto``
keeps the first call the model wrote. A request without tools takes none of these paths.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagelm.plugin_manager import get_plugin_manager
from pagelm.plugins.server.errors import APIError
from pagelm.plugins.tool_parsers.parser import StreamDelta, ToolCall, ToolCallDelta, ToolParser, accumulate
from pagelm.plugins.tool_parsers.streaming_json import PENDING, json_object_at
from pagelm.plugins.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatResponseMessage,
    ChatToolCall,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
)
from pagelm.sampling_params import GuidedDecodingParams

# OpenAI's rule for function names.
FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_NAMED_USAGE = 'a named tool_choice is {"type": "function", "function": {"name": "<one of tools>"}}'


class ToolCalling:
    """The server's tool-calling settings (``--enable-auto-tool-choice``,
    ``--tool-call-parser``), and what they make of each chat request."""

    def __init__(
        self, tokenizer: Any, tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
        exclude_tools_when_tool_choice_none: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        # vLLM's flag: with tool_choice "none" the chat template gets no tools, so the model
        # is not told about functions it may not call (and the prompt is shorter).
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none
        self.parser_cls: type[ToolParser] | None = None
        if tool_call_parser is not None:  # an unknown name lists the registered ones
            self.parser_cls = get_plugin_manager().collect("tool call parser").get(tool_call_parser)
        if enable_auto_tool_choice and self.parser_cls is None:
            names = ", ".join(get_plugin_manager().collect("tool call parser").names())
            raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser NAME (registered: {names})")
        self.enable_auto_tool_choice = enable_auto_tool_choice

    def prepare(self, req: ChatCompletionRequest) -> ToolRequest | None:
        """The request's tool calling, checked (a 400 naming the field); None without tools."""
        tools = check_tools(req.tools)
        choice = req.tool_choice
        if choice is None:
            choice = "auto" if tools else "none"
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise APIError(
                f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}',
                param="tool_choice",
            )
        if req.tools is None and choice != "none":
            raise APIError("tool_choice needs tools: give the functions the model may call in tools", param="tool_choice")
        named = _named_tool(choice, tools) if isinstance(choice, dict) else None
        if not tools:  # an empty list offers nothing: OpenAI treats even "required" as "none"
            return None
        max_calls = 1 if req.parallel_tool_calls is False else None
        if choice == "none":
            return ToolRequest("none", [] if self.exclude_tools_when_tool_choice_none else tools)
        if choice == "auto":
            if not self.enable_auto_tool_choice:
                raise APIError(
                    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                    param="tool_choice",
                )
            parser_cls = self.parser_cls
            return ToolRequest("auto", tools, lambda: parser_cls(self.tokenizer, tools), max_calls=max_calls)
        if choice == "required":
            guided = GuidedDecodingParams(json=required_schema(tools, max_calls))
            return ToolRequest(
                "required", tools, lambda: RequiredToolCalls(self.tokenizer, tools), guided, ("tools", "tools"), max_calls
            )
        index, function = named
        name = function["name"]
        guided = GuidedDecodingParams(json=function.get("parameters") or {"type": "object"})
        where = f"tools[{index}].function.parameters"
        return ToolRequest("named", tools, lambda: NamedToolCall(self.tokenizer, tools, name), guided, (where, where))


@dataclass
class ToolRequest:
    """One request's tool calling: its ``tool_choice`` (``named`` for a function), the tools
    for the chat template, a parser per choice, and the guided decoding that ``required``
    and named choices run under."""

    choice: str
    tools: list[dict[str, Any]]
    make_parser: Callable[[], ToolParser] | None = None
    guided: GuidedDecodingParams | None = None
    guided_field: tuple[str, str] | None = None  # (param, where) for a schema the backend refuses
    max_calls: int | None = None  # parallel_tool_calls=false: 1

    def constrain(
        self, guided: GuidedDecodingParams | None, guided_field: tuple[str, str] | None
    ) -> tuple[GuidedDecodingParams | None, tuple[str, str] | None]:
        """The request's output constraint: the tool schema for ``required`` and named
        choices, which leave no room for another (a 400 naming it)."""
        if self.guided is None:
            return guided, guided_field
        if guided is not None:
            raise APIError(
                f"tool_choice={'a named function' if self.choice == 'named' else self.choice!r} constrains the "
                f"output to tool calls already; drop {guided_field[0]}",
                param=guided_field[0],
            )
        return self.guided, self.guided_field

    def message(self, text: str, finish_reason: str | None) -> tuple[ChatResponseMessage, str | None]:
        """A whole choice's message and finish reason."""
        if self.make_parser is None:
            return ChatResponseMessage(content=text), finish_reason
        parsed = self.make_parser().extract_tool_calls(text)
        calls = [
            ChatToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in parsed.tool_calls[:self.max_calls]
        ]
        message = ChatResponseMessage(content=parsed.content, tool_calls=calls or None)
        return message, self._finish_reason(bool(calls), finish_reason)

    def stream(self) -> ToolStream | None:
        """What turns one choice's streamed text into deltas (None: plain text)."""
        return None if self.make_parser is None else ToolStream(self)

    def _finish_reason(self, called: bool, finish_reason: str | None) -> str | None:
        if called and finish_reason == "stop" and self.choice in ("auto", "required"):
            return "tool_calls"
        return finish_reason


class ToolStream:
    """One choice's parser, fed the choice's text as it streams."""

    def __init__(self, request: ToolRequest) -> None:
        self.request = request
        self.parser = request.make_parser()
        self.text = ""
        self.called = False

    def delta(self, new_text: str, finish_reason: str | None) -> tuple[DeltaMessage | None, str | None]:
        """The delta for ``new_text`` (None: nothing to send yet) and the finish reason."""
        d = self.parser.extract_tool_calls_streaming(self.text, new_text, finish_reason is not None)
        self.text += new_text
        if self.request.max_calls is not None:
            d.tool_calls = [c for c in d.tool_calls if c.index < self.request.max_calls]
        self.called = self.called or bool(d.tool_calls)
        message = None if not d else DeltaMessage(content=d.content or None, tool_calls=[
            DeltaToolCall(
                index=c.index, id=c.id, type="function" if c.id else None,
                function=DeltaFunctionCall(name=c.name, arguments=c.arguments),
            ) for c in d.tool_calls
        ] or None)
        return message, self.request._finish_reason(self.called, finish_reason)


# ---- the forced choices' "parsers": what the guided output means ------------------------------


class NamedToolCall(ToolParser):
    """A named ``tool_choice``: the (guided) output is the function's arguments, streamed as
    they are written."""

    name = "(named tool_choice)"

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]], function_name: str) -> None:
        super().__init__(tokenizer, tools)
        self.function_name = function_name
        self._call: ToolCall | None = None

    def extract_tool_calls_streaming(self, previous_text: str, delta_text: str, finished: bool) -> StreamDelta:
        if self._call is None:
            self._call = ToolCall(self.function_name, "")
            return StreamDelta(tool_calls=[ToolCallDelta(0, self._call.id, self.function_name, delta_text)])
        return StreamDelta(tool_calls=[ToolCallDelta(0, arguments=delta_text)] if delta_text else [])

    def extract_tool_calls(self, model_output: str):
        return accumulate([NamedToolCall(self.tokenizer, self.tools, self.function_name)
                           .extract_tool_calls_streaming("", model_output, True)])


class RequiredToolCalls(ToolParser):
    """``tool_choice="required"``: the (guided) output is ``[{"name": ..., "parameters":
    {...}}, ...]``; each element goes out as a call once it is complete. Output cut short
    (``max_tokens``) keeps its complete calls; the rest is content (all of it when no call
    completed), as the parsers do. Nothing after the closing ``]`` is sent."""

    name = "(required tool_choice)"

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        super().__init__(tokenizer, tools)
        self._pos: int | None = None  # where the next element may start
        self._content_from: int | None = None
        self._num_calls = 0
        self._closed = False
        self._tried = 0  # text before this held no "}" that could close the pending element

    def extract_tool_calls_streaming(self, previous_text: str, delta_text: str, finished: bool) -> StreamDelta:
        text = previous_text + delta_text
        out = StreamDelta()
        if self._content_from is None and not self._closed:
            if self._pos is None:
                lead = text.lstrip()
                if lead.startswith("["):
                    self._pos = len(text) - len(lead) + 1
                elif lead or finished:
                    self._content_from = 0
            while self._pos is not None and self._next_call(text, finished, out):
                pass
        if self._content_from is not None:
            out.content = text[self._content_from:]
            self._content_from = len(text)
        return out

    def _next_call(self, text: str, finished: bool, out: StreamDelta) -> bool:
        at = self._pos
        while at < len(text) and (text[at].isspace() or (text[at] == "," and self._num_calls)):
            at += 1
        if at == len(text) and not finished:
            return False
        if at < len(text) and text[at] == "]" and self._num_calls:
            self._pos, self._closed = None, True
            return False
        if at < len(text) and text[at] == "{":
            obj, end = json_object_at(text, at, finished, self._tried)
            if obj is PENDING:
                self._tried = end
                return False
            if isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("parameters"), dict):
                call = ToolCall(obj["name"], json.dumps(obj["parameters"], ensure_ascii=False))
                out.tool_calls.append(ToolCallDelta(self._num_calls, call.id, call.name, call.arguments))
                self._num_calls += 1
                self._pos = end
                return True
        self._pos, self._content_from = None, at if self._num_calls else 0
        return False


# ---- checks and schemas -----------------------------------------------------------------------


def check_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``tools`` as OpenAI defines them: function tools with a valid, distinct name and an
    object schema for parameters (a 400 naming the first wrong one)."""
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if tool.get("type", "function") != "function":
            raise APIError(f'{where}.type must be "function", got {tool.get("type")!r}', param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise APIError(f"{where}.function must be an object with a name, got {function!r}", param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise APIError(
                f"{where}.function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {name!r}",
                param=f"{where}.function.name",
            )
        if name in seen:
            raise APIError(f"{where}.function.name {name!r} is also tools[{seen[name]}]'s", param=f"{where}.function.name")
        seen[name] = i
        params = function.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise APIError(
                f"{where}.function.parameters must be a JSON schema of an object ({{\"type\": \"object\", ...}}), "
                f"got {json.dumps(params)[:200]}",
                param=f"{where}.function.parameters",
            )
    return list(tools or [])


def _named_tool(choice: dict[str, Any], tools: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    function = choice.get("function")
    if choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(f"tool_choice: {_NAMED_USAGE}, got {json.dumps(choice)[:200]}", param="tool_choice")
    for i, tool in enumerate(tools):
        if tool["function"]["name"] == function["name"]:
            return i, tool["function"]
    names = ", ".join(t["function"]["name"] for t in tools) or "none"
    raise APIError(
        f"tool_choice names function {function['name']!r}, which is not in tools (given: {names})", param="tool_choice"
    )


def required_schema(tools: list[dict[str, Any]], max_calls: int | None = None) -> dict[str, Any]:
    """The JSON schema ``required`` decodes under (vLLM's): at least one (at most
    ``max_calls``) ``{"name": <a tool>, "parameters": <its schema>}``. Each tool's ``$defs``
    move to the top, where its ``#/$defs/...`` references then point."""
    defs: dict[str, Any] = {}
    variants = []
    for i, tool in enumerate(tools):
        params = copy.deepcopy(tool["function"].get("parameters") or {"type": "object", "properties": {}})
        for name, schema in params.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise APIError(
                    f"tools[{i}].function.parameters: $defs {name!r} differs from another tool's, which "
                    'tool_choice="required" cannot combine',
                    param=f"tools[{i}].function.parameters",
                )
        variants.append({
            "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]}, "parameters": params},
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    if defs:
        schema["$defs"] = defs
    return schema


def template_message(m: ChatMessage, i: int, message: dict[str, Any]) -> dict[str, Any]:
    """``message`` (the turn as the chat template gets it) with the turn's tool calls, their
    arguments as objects as Hugging Face templates expect, and the call a tool answers."""
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.tool_calls is None:
        return message
    calls = []
    for j, call in enumerate(m.tool_calls):
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(
                f"messages[{i}].tool_calls[{j}] needs function.name and function.arguments",
                param=f"messages[{i}].tool_calls",
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass  # the template gets the text as it came
        calls.append({**call, "function": {**function, "arguments": arguments}})
    message["tool_calls"] = calls
    return message
