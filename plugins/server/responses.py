"""The work behind ``POST /v1/responses`` (OpenAI's Responses API). Its input becomes chat
messages that take the chat path - chat template, sampling parameters, the same checks and
400s - and one assistant message comes back: whole, or as the event sequence the openai
SDK's stream reader expects.

Only what maps onto one generation is served; tools, stored responses
(``previous_response_id``), background runs and the like are a 400 naming the parameter."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi.responses import StreamingResponse

from pagelm.engine.input_processor import ProcessedRequest
from pagelm.outputs import RequestOutput
from pagelm.plugins.server.errors import APIError
from pagelm.plugins.server.protocol import ChatCompletionRequest, ChatMessage, JsonSchemaFormat, ResponseFormat
from pagelm.plugins.server.responses_protocol import (
    OPENAI_RESPONSES_FIELDS,
    ContentPartEvent,
    ErrorEvent,
    IncompleteDetails,
    InputTokensDetails,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    OutputTextDeltaEvent,
    OutputTextDoneEvent,
    ResponseErrorInfo,
    ResponseLifecycleEvent,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
    StreamEvent,
    TextConfig,
)
from pagelm.plugins.server.serving import OpenAIServing, _as_api_error, _first_output, _gather, _prepend, _sse

# Roles of input messages, as the chat template sees them: templates know "system", few know
# "developer" (which the Responses API treats as the same thing).
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
# Text parts: input_text in user/system messages, output_text in an earlier assistant reply
# that a client sends back as context.
_TEXT_PARTS = frozenset({"input_text", "output_text"})
# Chat-path parameter names in errors -> their Responses names.
_PARAM_NAMES = {"messages": "input", "response_format": "text.format"}

_UNSUPPORTED = {
    "tools": "tools are not supported by this server",
    "previous_response_id": "previous_response_id is not supported: this server stores no responses; send the "
    "conversation as input",
    "conversation": "conversation is not supported: this server stores no conversations; send them as input",
    "background": "background responses are not supported",
    "prompt": "prompt templates are not supported",
    "reasoning": "reasoning options are not supported",
    "include": "include is not supported",
    "top_logprobs": "top_logprobs is not supported on /v1/responses",
    "max_tool_calls": "max_tool_calls is not supported: this server has no tools",
}


class ResponsesServing:
    """``/v1/responses`` on top of the chat path of ``serving``."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, req: ResponsesRequest) -> ResponsesResponse | StreamingResponse:
        serving = self.serving
        serving.check_model(req.model)
        serving.check_fields(req, OPENAI_RESPONSES_FIELDS)
        check_supported(req)
        serving.check_engine()
        prompt = await asyncio.to_thread(self._inputs, req)  # tokenizing: off the event loop
        response_id = f"resp_{uuid.uuid4().hex}"
        started = self._response(response_id, req)
        if req.stream:
            # The first event goes out with the engine's first output, as for chat: an error
            # the engine finds first is an HTTP error, not an event after a 200.
            outputs = serving.engine.generate(prompt, prompt.params, response_id, cache_salt=req.cache_salt)
            first = await _first_output(outputs)
            return _sse(self._stream(started, outputs, first))
        out = (await _gather([serving._final(prompt, response_id, req)]))[0]
        c = out.outputs[0]
        return _finished(started, f"msg_{uuid.uuid4().hex}", c.text, len(c.token_ids), c.finish_reason, out)

    def _inputs(self, req: ResponsesRequest) -> ProcessedRequest:
        """The request as a chat request, rendered, tokenized and checked by the chat path
        (on a worker thread); its errors name the Responses parameters."""
        serving = self.serving
        try:
            chat = ChatCompletionRequest(
                messages=chat_messages(req), max_tokens=req.max_output_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k,
                repetition_penalty=req.repetition_penalty, seed=req.seed, stop=req.stop,
                stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, priority=req.priority,
                cache_salt=req.cache_salt, extra_args=req.extra_args, response_format=response_format(req.text),
            )
            params = serving.sampling_params(
                chat, max_tokens=req.max_output_tokens, max_tokens_name="max_output_tokens", logprobs=None,
                logprobs_name="top_logprobs",
            )
            return serving.check_prompt(serving._chat_prompt(chat), params, req.priority, "input", "max_output_tokens")
        except APIError as exc:
            raise _in_responses_terms(exc) from None

    def _response(self, response_id: str, req: ResponsesRequest) -> ResponsesResponse:
        """The response object as it starts (in progress, no output): what it echoes of the
        request."""
        text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text is not None else None
        return ResponsesResponse(
            id=response_id, model=self.serving.model_name, status="in_progress", instructions=req.instructions,
            max_output_tokens=req.max_output_tokens, metadata=req.metadata,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, user=req.user,
            tool_choice=req.tool_choice or "auto",
            parallel_tool_calls=True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            **({"text": text} if text else {}),
        )

    async def _stream(
        self, started: ResponsesResponse, outputs: AsyncIterator[RequestOutput], first: RequestOutput
    ) -> AsyncIterator[str]:
        """response.created, response.in_progress, response.output_item.added,
        response.content_part.added, response.output_text.delta..., response.output_text.done,
        response.content_part.done, response.output_item.done, response.completed (with
        status "incomplete" when max_output_tokens cut it, as vLLM sends it: the SDK's
        ``get_final_response`` needs response.completed). An error mid-stream: an ``error``
        event, then response.failed."""
        sequence = itertools.count()

        def sse(event: StreamEvent) -> str:
            event.sequence_number = next(sequence)
            return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"

        item_id = f"msg_{uuid.uuid4().hex}"
        part = dict(output_index=0, item_id=item_id, content_index=0)
        yield sse(ResponseLifecycleEvent(type="response.created", response=started))
        yield sse(ResponseLifecycleEvent(type="response.in_progress", response=started))
        yield sse(OutputItemEvent(
            type="response.output_item.added", output_index=0, item=OutputMessage(id=item_id, status="in_progress")
        ))
        yield sse(ContentPartEvent(type="response.content_part.added", part=OutputText(text=""), **part))
        texts, num_tokens, last = [], 0, first
        try:
            async with aclosing(outputs):  # closing it (client gone) aborts the request
                async for out in _prepend(first, outputs):
                    c, last = out.outputs[0], out
                    num_tokens += len(c.token_ids)
                    if c.text:
                        texts.append(c.text)
                        yield sse(OutputTextDeltaEvent(delta=c.text, **part))
        except Exception as exc:  # the status line is gone: say it in the stream
            err = _as_api_error(exc)
            yield sse(ErrorEvent(code=err.code or err.type, message=err.message, param=err.param))
            info = ResponseErrorInfo(code="server_error" if err.status >= 500 else "invalid_prompt", message=err.message)
            failed = started.model_copy(update={"status": "failed", "error": info})
            yield sse(ResponseLifecycleEvent(type="response.failed", response=failed))
            return
        text = "".join(texts)
        finish_reason = last.outputs[0].finish_reason if last.finished else "abort"
        response = _finished(started, item_id, text, num_tokens, finish_reason, last)
        message = response.output[0]
        yield sse(OutputTextDoneEvent(text=text, **part))
        yield sse(ContentPartEvent(type="response.content_part.done", part=message.content[0], **part))
        yield sse(OutputItemEvent(type="response.output_item.done", output_index=0, item=message))
        yield sse(ResponseLifecycleEvent(type="response.completed", response=response))


def _finished(
    started: ResponsesResponse, item_id: str, text: str, num_tokens: int, finish_reason: str | None,
    out: RequestOutput,
) -> ResponsesResponse:
    """``started`` with its output message and usage: completed when the model stopped,
    incomplete (reason max_output_tokens) when the token limit cut it."""
    if finish_reason == "stop":
        status, item_status, details = "completed", "completed", None
    elif finish_reason == "length":
        status, item_status, details = "incomplete", "incomplete", IncompleteDetails(reason="max_output_tokens")
    else:  # aborted
        status, item_status, details = "cancelled", "incomplete", None
    num_prompt = len(out.prompt_token_ids)
    usage = ResponseUsage(
        input_tokens=num_prompt, input_tokens_details=InputTokensDetails(cached_tokens=out.num_cached_tokens),
        output_tokens=num_tokens, total_tokens=num_prompt + num_tokens,
    )
    message = OutputMessage(id=item_id, status=item_status, content=[OutputText(text=text)])
    return started.model_copy(update={"status": status, "output": [message], "usage": usage, "incomplete_details": details})


def check_supported(req: ResponsesRequest) -> None:
    """A 400 naming the first Responses feature the request uses that this server lacks."""
    used = {
        "tools": bool(req.tools),
        "previous_response_id": req.previous_response_id is not None,
        "conversation": req.conversation is not None,
        "background": bool(req.background),
        "prompt": req.prompt is not None,
        "reasoning": any(v is not None for v in (req.reasoning or {}).values()),
        "include": bool(req.include),
        "top_logprobs": bool(req.top_logprobs),
        "max_tool_calls": req.max_tool_calls is not None,
    }
    for name, is_used in used.items():
        if is_used:
            raise APIError(_UNSUPPORTED[name], param=name)
    if req.tool_choice not in (None, "none", "auto"):
        raise APIError(f"tool_choice must be none or auto (this server has no tools), got {req.tool_choice!r}",
                       param="tool_choice")
    if req.truncation not in (None, "disabled"):
        raise APIError(f"truncation must be disabled, got {req.truncation!r}", param="truncation")


def chat_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """``instructions`` (a system message) and ``input`` as chat messages with text content."""
    messages = [] if req.instructions is None else [ChatMessage(role="system", content=req.instructions)]
    if isinstance(req.input, str):
        return messages + [ChatMessage(role="user", content=req.input)]
    if not req.input:
        raise APIError("input must not be empty", param="input")
    for i, item in enumerate(req.input):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind != "message":
            raise APIError(f"{where}: input items of type {kind!r} are not supported (only messages)",
                           param=f"{where}.type")
        role = item.get("role")
        if role not in _ROLES:
            raise APIError(f"{where}.role must be user, system, developer or assistant, got {role!r}",
                           param=f"{where}.role")
        messages.append(ChatMessage(role=_ROLES[role], content=_message_text(item.get("content"), f"{where}.content")))
    return messages


def _message_text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where} must be a string or a list of input_text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(f"{where}.{j}: only input_text and output_text parts are supported, got {kind!r}",
                           param=f"{where}.{j}")
        texts.append(part["text"])
    return "".join(texts)


def response_format(text: TextConfig | None) -> ResponseFormat | None:
    """``text.format`` as the chat path's ``response_format`` (None: plain text)."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError("text.format of type json_schema needs a schema", param="text.format.schema")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name=fmt.name, schema=fmt.schema_))
    raise APIError(f"text.format.type must be text, json_object or json_schema, got {fmt.type!r}",
                   param="text.format.type")


def _in_responses_terms(exc: APIError) -> APIError:
    """A chat-path error with the Responses names of what it is about."""
    if exc.param in _PARAM_NAMES:
        exc.param = _PARAM_NAMES[exc.param]
    exc.message = exc.message.replace("response_format.json_schema.schema", "text.format.schema")
    exc.args = (exc.message,)
    return exc
