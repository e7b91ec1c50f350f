"""Schemas of the OpenAI Responses API (``POST /v1/responses``): the request, the response
object and the server-sent events of a streamed response, with the field names the openai
SDK reads."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from pagelm.sampling_params import INT64_MAX
from pagelm.plugins.server.protocol import Count, Int64, OpenAIModel, RequestBody, RequestPart, TokenId

# Fields the Responses API defines that change nothing here: accepted and ignored. (``store``:
# nothing is stored, as in vLLM without its response store; no later request can refer to
# this one.) Anything else unknown is a 400 naming it.
OPENAI_RESPONSES_FIELDS = frozenset({
    "prompt_cache_key", "prompt_cache_retention", "safety_identifier", "service_tier", "store", "stream_options",
})


class TextFormat(RequestPart):
    """``text.format``: plain text, any JSON object, or JSON following ``schema``."""

    type: str = "text"  # text, json_object or json_schema
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestPart):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(RequestBody):
    model: str | None = None
    # A string (one user message) or message items: {"role", "content"} with content a string
    # or a list of input_text / output_text parts. Checked in responses.py, which names the
    # item at fault (input.2.content.0).
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none" or "auto" (no tools are served)
    truncation: str | None = None  # "disabled" only
    # Responses features this server does not have: a 400 naming them when used.
    tools: list[dict[str, Any]] | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: Count | None = None
    max_tool_calls: Count | None = None
    # vLLM's extras, as on its /v1/responses
    top_k: int = Field(0, ge=-1, le=INT64_MAX)  # 0 or -1: off
    repetition_penalty: float = 1.0
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    priority: Int64 = 0
    cache_salt: str | None = None
    extra_args: dict[str, Any] | None = None


# ---- the response object --------------------------------------------------------------------


class OutputText(OpenAIModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(OpenAIModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText] = Field(default_factory=list)


class InputTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIModel):
    reason: str | None = None  # max_output_tokens


class ResponseErrorInfo(OpenAIModel):
    code: str
    message: str


class ResponsesResponse(OpenAIModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]
    output: list[OutputMessage] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tools: list[Any] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    truncation: str = "disabled"
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    background: bool = False
    store: bool = False
    user: str | None = None


# ---- streamed events -------------------------------------------------------------------------
# One event per SSE message, ``event: <type>`` and ``data: <json>``; sequence_number counts
# from 0 in each stream.


class StreamEvent(OpenAIModel):
    type: str
    sequence_number: int = 0


class ResponseLifecycleEvent(StreamEvent):
    """response.created, response.in_progress, response.completed, response.failed"""

    response: ResponsesResponse


class OutputItemEvent(StreamEvent):
    """response.output_item.added, response.output_item.done"""

    output_index: int
    item: OutputMessage


class ContentEvent(StreamEvent):
    """An event about one content part: where it sits in the output."""

    output_index: int
    item_id: str
    content_index: int


class ContentPartEvent(ContentEvent):
    """response.content_part.added, response.content_part.done"""

    part: OutputText


class OutputTextDeltaEvent(ContentEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class OutputTextDoneEvent(ContentEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ErrorEvent(StreamEvent):
    type: Literal["error"] = "error"
    code: str | None = None
    message: str
    param: str | None = None
