"""The tool-call parser contract: how the OpenAI server splits a model's text, written in
the model's own tool-call format, into content and tool calls (``pagelm serve
--tool-call-parser NAME``; docs/plugins.md, "Writing a tool-call parser").

One parser object serves one choice of one request. The rule: however the output is cut
into deltas, they add up (:func:`accumulate`) to ``extract_tool_calls`` of the whole text, so
a parser never sends what it may have to take back (``check_tool_parser``,
``pagelm.plugins.tool_parsers.conformance``, checks it at every character boundary).

Tool-call parsers are a plugin kind of the ``tool_parsers`` plugin, which adds the hook below
to the plugin manager.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import pluggy

if TYPE_CHECKING:
    from pagelm.registry import Registry


def make_tool_call_id() -> str:
    """A fresh tool call id, in vLLM's form (``chatcmpl-tool-<32 hex>``)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    name: str
    # The arguments object as JSON text (OpenAI's ``function.arguments`` is a string).
    arguments: str
    id: str = field(default_factory=make_tool_call_id)


@dataclass
class ExtractedToolCalls:
    """A whole output, split: ``content`` is None when nothing but calls was written."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ToolCallDelta:
    """One call's piece of a streamed delta. A call's first piece carries its ``id`` and
    ``name``; ``arguments`` pieces join into the arguments text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    """What one streamed step adds to the message (vLLM's ``DeltaMessage``)."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class ToolParser(ABC):
    """Subclass, set ``name`` and implement ``extract_tool_calls_streaming``; the whole-text
    ``extract_tool_calls`` comes from it."""

    name: ClassVar[str]

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        # tools: the request's, as OpenAI gives them ({"type": "function", "function": {...}}).
        self.tokenizer = tokenizer
        self.tools = tools

    @abstractmethod
    def extract_tool_calls_streaming(self, previous_text: str, delta_text: str, finished: bool) -> StreamDelta:
        """The next delta of the message, given the output so far (``previous_text``, all
        text given before) and its new text. ``finished``: no text follows; send all that is
        held. Called once per streamed engine output, never per token by the engine."""

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        """The whole output, split into content and calls (non-streaming responses)."""
        fresh = type(self)(self.tokenizer, self.tools)
        return accumulate([fresh.extract_tool_calls_streaming("", model_output, True)])


def accumulate(deltas: Iterable[StreamDelta]) -> ExtractedToolCalls:
    """What a client assembles from streamed deltas: the content joined, and each call's
    id and name from its first piece with its argument pieces joined."""
    content: list[str] = []
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        content.append(delta.content)
        for piece in delta.tool_calls:
            call = calls.get(piece.index)
            if call is None:
                if piece.name is None:
                    raise ValueError(f"tool call {piece.index}'s first delta has no name")
                calls[piece.index] = call = ToolCall(piece.name, "", piece.id or make_tool_call_id())
            call.arguments += piece.arguments
    if sorted(calls) != list(range(len(calls))):
        raise ValueError(f"tool call indexes must count up from 0, got {sorted(calls)}")
    return ExtractedToolCalls("".join(content) or None, [calls[i] for i in range(len(calls))])


@pluggy.HookspecMarker("pagelm")
def pagelm_register_tool_parsers(registry: "Registry") -> None:
    """Add ``ToolParser`` subclasses: ``registry.add(name, parser_cls)``. The name is what
    ``pagelm serve --tool-call-parser`` selects."""
