"""Request and response schemas of the OpenAI-compatible API (the fields the OpenAI client
sends, plus vLLM's extras: top_k, min_p, repetition_penalty, ignore_eos, priority, cache_salt...)."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from pagelm.plugins.server.body_checks import check_body
from pagelm.sampling_params import INT64_MAX, INT64_MIN


# Every integer a request carries is bounded here, as vLLM bounds it, so that the server
# answers 400 naming it before anything leaves the API process: 2**63 once passed, crossed the
# wire and crashed the engine core's step for every client.
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
# A number of top logprobs, or vLLM's -1: the whole vocabulary (bounded by --max-logprobs).
LogprobCount = Annotated[int, Field(ge=-1, le=INT64_MAX)]

# A union of lists stops at the first bad item of each member (fail_fast): otherwise
# pydantic tried ``list[str]`` on a million token ids and built a million errors first,
# holding the event loop for a second per 2.5 M ids.
_FAIL_FAST = Field(fail_fast=True)
PromptInput = Union[
    str, Annotated[list[str], _FAIL_FAST], Annotated[list[int], _FAIL_FAST],
    Annotated[list[Annotated[list[int], _FAIL_FAST]], _FAIL_FAST],
]


class OpenAIModel(BaseModel):
    # Nested objects (messages, content parts) keep what newer clients add to them.
    model_config = ConfigDict(extra="ignore")


class RequestPart(OpenAIModel):
    """Part of a request: typed strictly, as vLLM does: ``"max_tokens": "16"`` or
    ``"logprobs": "yes"`` is a 400 naming the field, not coerced (an integer is still a
    valid float)."""

    model_config = ConfigDict(extra="ignore", strict=True)


class RequestBody(RequestPart):
    """A top-level request: extra fields are kept (``model_extra``) so that the server can
    name them in a 400 (``OpenAIServing.check_fields``) rather than silently drop a typo."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _text_and_depth(cls, data: Any) -> Any:
        # Raises APIError, which is no ValueError: pydantic lets it through to the server's
        # handler, a 400 naming the field (see body_checks).
        check_body(data)
        return data


# Fields the OpenAI API defines that pagelm does not model: accepted and ignored, so that
# clients that send them keep working. Anything else unknown is a 400 naming it.
OPENAI_COMPLETION_FIELDS = frozenset({"user"})
OPENAI_CHAT_FIELDS = frozenset({
    "audio", "function_call", "functions", "metadata", "modalities", "prediction",
    "prompt_cache_key", "reasoning_effort", "safety_identifier", "service_tier", "store", "user",
    "verbosity", "web_search_options",
})


class StrictPart(RequestPart):
    """A nested object whose every field pagelm knows: an unknown one is a 400 naming it
    (a typo in ``continuous_usage_stats`` would otherwise silently do nothing)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictPart):
    include_usage: bool = False
    # vLLM: usage in every chunk (with include_usage), counting the tokens so far.
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None  # OpenAI's; nothing to obfuscate here: ignored


class StructuredOutputs(StrictPart):
    """vLLM's ``structured_outputs`` (its newer name for guided decoding): one constraint."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's options pagelm's backend does not take: a 400 naming them when set.
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


class JsonSchemaFormat(RequestPart):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestPart):
    type: str = "text"  # text, json_object or json_schema
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(RequestBody):
    """What completions and chat completions share."""

    model: str | None = None
    n: int = Field(1, ge=1, le=INT64_MAX)  # and at most the server's --max-n
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(0, ge=-1, le=INT64_MAX)  # 0 or -1: off; beyond the vocabulary: every token
    min_p: float = 0.0
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: Count = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None  # token id (as JSON keys are) -> [-100, 100]
    # vLLM's logits processors and prompt options
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: LogprobCount | None = None  # not with stream; at most the engine's max_logprobs
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    return_tokens_as_token_ids: bool | None = None  # logprobs' tokens as "token_id:123"
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # pagelm / vLLM extras
    priority: Int64 = 0
    cache_salt: str | None = Field(None, min_length=1)  # "" would share the unsalted cache
    # Per-request data for plugins (SamplingParams.extra_args); the openai client sends it
    # with extra_body={"extra_args": {...}}.
    extra_args: dict[str, Any] | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs, or one of its
    # older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: Count | None = 16
    logprobs: Count | None = None  # at most the engine's max_logprobs; no -1 here, as in vLLM
    echo: bool = False
    suffix: str | None = None
    best_of: Count | None = None


class ChatMessage(RequestPart):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # An assistant turn's calls, and a tool turn's answer to one (checked in tools.py).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None  # and at most the engine's max_logprobs
    # Checked, with their error messages, in tools.py.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    add_generation_prompt: bool = True
    # vLLM: render the last (assistant) message open, for the model to continue it.
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template


# ---- responses ----------------------------------------------------------------------------


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class Usage(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIModel):
    """One token's entry in vLLM's ``prompt_logprobs`` (its ``Logprob``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position: token id -> its entry (the prompt's token and the top-k); None for the
# first token, which nothing scores.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text


class ChatToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ChatToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_tool_calls(self, handler):
        # Only a message with calls names them (a plain answer looks as it did before tools).
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None


class _DeltaPart(OpenAIModel):
    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        # A delta names only what it carries ({"content": "..."}), as OpenAI's do.
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_DeltaPart):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DeltaPart):
    """A call's piece: the first one carries ``id``, ``type`` and ``function.name``."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_DeltaPart):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagelm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestBody):
    """vLLM's two ``/tokenize`` requests in one: a ``prompt``, or chat ``messages`` with the
    chat fields that shape the rendered prompt (``tools``, ``chat_template_kwargs``...)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # None: vLLM's defaults, true for a prompt, false for messages (the template has its own).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIModel):
    prompt: str
