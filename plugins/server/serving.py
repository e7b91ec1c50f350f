"""The work behind ``/v1/completions`` and ``/v1/chat/completions``: validate, turn the request
into prompts + ``SamplingParams``, run them through ``AsyncLLM`` and shape the results as
OpenAI responses or server-sent events.

Everything that can be checked is checked before the first byte goes out, so bad input is a
400 and never a broken stream."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi.responses import StreamingResponse

from pagelm.engine.async_llm import AsyncLLM, EngineDeadError
from pagelm.engine.core_client import EngineShuttingDown
from pagelm.engine.core_output import EngineStepError
from pagelm.engine.input_processor import ProcessedRequest
from pagelm.engine.output_processor import OutputKind
from pagelm.multimodal import content_parts_to_text
from pagelm.outputs import CompletionOutput, Logprob, RequestOutput
from pagelm.sampling_params import GuidedDecodingParams, SamplingParams
from pagelm.plugins.server import DEFAULT_MAX_N, DEFAULT_MAX_SEQUENCES_PER_REQUEST, DEFAULT_MAX_STOP_STRINGS
from pagelm.plugins.server.errors import APIError, param_of
from pagelm.plugins.server.media import ImageFetcher
from pagelm.plugins.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    OPENAI_CHAT_FIELDS,
    OPENAI_COMPLETION_FIELDS,
    DeltaMessage,
    PromptLogprob,
    PromptTokensDetails,
    RequestBody,
    SamplingFields,
    StructuredOutputs,
    TopLogprob,
    Usage,
)
from pagelm.plugins.server.tools import ToolCalling, ToolRequest, template_message

COMPLETION_DEFAULT_MAX_TOKENS = 16
_SAMPLING_NAMES = {
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "stop", "stop_token_ids", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
    "extra_args", "priority", "logit_bias", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
}
_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# structured_outputs' options pagelm's structured-output backend does not take.
_STRUCTURED_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "structural_tag")
# apply_chat_template's own arguments: chat_template_kwargs may not set them (they are fields
# of the request, or the server's to decide).
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
})


class OpenAIServing:
    def __init__(
        self, engine: AsyncLLM, model_name: str, *, allow_unknown_fields: bool = False, max_n: int = DEFAULT_MAX_N,
        trust_request_chat_template: bool = False, max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS,
        tool_calling: ToolCalling | None = None, max_sequences: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST,
        images: ImageFetcher | None = None,
    ) -> None:
        self.engine = engine
        self.allow_unknown_fields = allow_unknown_fields
        self.max_n = max_n
        self.max_sequences = max_sequences
        self.max_stop_strings = max_stop_strings
        self.trust_request_chat_template = trust_request_chat_template
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        if self.tokenizer is None:
            raise ValueError("the OpenAI server needs a tokenizer: do not set skip_tokenizer_init")
        self.tool_calling = tool_calling or ToolCalling(self.tokenizer)
        self.images = images or ImageFetcher()

    # ---- checks shared by both endpoints --------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(f"The model `{name}` does not exist.", 404, param="model", code="model_not_found")

    def check_fields(self, req: RequestBody, openai_fields: frozenset[str] = frozenset()) -> None:
        """A field neither pagelm nor the OpenAI API defines (a typo such as ``priority_``, or
        a vLLM extra pagelm does not implement) is a 400 naming it, not silently dropped;
        ``--allow-unknown-fields`` restores ignoring them for clients that send extras."""
        unknown = sorted(set(req.model_extra or ()) - openai_fields)
        if unknown and not self.allow_unknown_fields:
            # A few names, not all: a body of 100,000 made-up fields made a 1 MB error.
            names = ", ".join(unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
            raise APIError(
                f"unknown field(s): {names} (start the server with --allow-unknown-fields "
                "to ignore fields it does not know)",
                param=unknown[0],
            )

    def check_engine(self) -> None:
        if self.engine.dead_error is not None:
            raise APIError(f"the engine is dead: {self.engine.dead_error}", 500)

    def sampling_params(
        self, req: SamplingFields, *, max_tokens: int | None, max_tokens_name: str, logprobs: int | None,
        logprobs_name: str, prompt_logprobs: int | None = None, tools: ToolRequest | None = None,
    ) -> SamplingParams:
        if req.stream_options is not None and not req.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")
        if req.stream and req.prompt_logprobs:  # vLLM's rule: they come with the final response
            raise APIError("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
        if not 0.0 <= req.temperature <= 2.0:
            raise APIError(f"temperature must be in [0, 2], got {req.temperature}", param="temperature")
        if req.n > self.max_n:
            raise APIError(f"n must be at most {self.max_n} (the server's --max-n), got {req.n}", param="n")
        if isinstance(req.stop, list) and len(req.stop) > self.max_stop_strings:
            # Each is searched for after every token of the request, in this process.
            raise APIError(
                f"stop must hold at most {self.max_stop_strings} strings (the server's --max-stop-strings), "
                f"got {len(req.stop)}",
                param="stop",
            )
        guided, guided_field = self.guided_decoding(req)
        if tools is not None:
            guided, guided_field = tools.constrain(guided, guided_field)
        kwargs: dict[str, Any] = dict(
            n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            seed=req.seed, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, stop=req.stop, stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos, max_tokens=max_tokens, min_tokens=req.min_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            guided_decoding=guided, extra_args=req.extra_args, logit_bias=req.logit_bias,
            allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )
        try:
            params = SamplingParams(**kwargs)
            self.engine.engine.inputs.check_params(params, req.priority)  # this engine's limits
            return params
        except (ValueError, TypeError) as exc:
            message, param = str(exc), param_of(str(exc), _SAMPLING_NAMES)
            if message.startswith("guided_decoding") and guided_field is not None:
                # "guided_decoding.json: invalid JSON schema: ..." -> the field used here
                name, where = guided_field
                raise APIError(re.sub(r"^guided_decoding(\.\w+)?", where, message), param=name) from None
            rename = {"max_tokens": max_tokens_name, "logprobs": logprobs_name}
            if param in rename and rename[param] != param:
                message = message.replace(param, rename[param], 1)
                param = rename[param]
            raise APIError(message, param=param) from None

    def guided_decoding(
        self, req: SamplingFields
    ) -> tuple[GuidedDecodingParams | None, tuple[str, str] | None]:
        """The request's output constraint (``response_format``, ``structured_outputs`` or one
        ``guided_*`` field), and (the field, the name to give it in errors): a bad schema,
        regex or grammar, which the input processor finds, is a 400 naming the field."""
        given = [name for name in _GUIDED_FIELDS if getattr(req, name) is not None]
        if req.structured_outputs is not None:
            given.insert(0, "structured_outputs")
        fmt = req.response_format
        if fmt is not None and fmt.type != "text":
            given.insert(0, "response_format")
        if not given:
            return None, None
        if len(given) > 1:
            raise APIError(f"give at most one output constraint, got {', '.join(given)}", param=given[1])
        name = given[0]
        where = "response_format.json_schema.schema" if name == "response_format" and fmt.type == "json_schema" else name
        try:
            if name == "structured_outputs":
                return _structured_outputs(req.structured_outputs)
            if name != "response_format":
                params = GuidedDecodingParams(**{name.removeprefix("guided_"): getattr(req, name)})
            elif fmt.type == "json_object":
                params = GuidedDecodingParams(json_object=True)
            elif fmt.type == "json_schema":
                if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                    raise APIError("response_format of type json_schema needs json_schema.schema", param=name)
                params = GuidedDecodingParams(json=fmt.json_schema.schema_)
            else:
                raise APIError(
                    f"response_format type must be text, json_object or json_schema, got {fmt.type!r}", param=name
                )
        except ValueError as exc:
            raise APIError(re.sub(r"^guided_decoding(\.\w+)?", where, str(exc)), param=name) from None
        return params, (name, where)

    def guided_source(self, req: SamplingFields) -> tuple[str, str] | None:
        """(the field that set the request's output constraint, the name errors give it)."""
        fmt = req.response_format
        if fmt is not None and fmt.type != "text":
            return "response_format", (
                "response_format.json_schema.schema" if fmt.type == "json_schema" else "response_format"
            )
        name = next((name for name in _GUIDED_FIELDS if getattr(req, name) is not None), None)
        return None if name is None else (name, name)

    def request_error(self, exc: BaseException, req: SamplingFields) -> BaseException:
        """An error the engine found in a request after it was queued, named after the field
        that caused it: a grammar that did not compile within the time limit, or one that
        allows no token ("guided_decoding: ..." -> "guided_json: ...", param guided_json)."""
        message = str(exc)
        source = self.guided_source(req) if isinstance(exc, ValueError) and message.startswith("guided_decoding") else None
        if source is None:
            return exc
        name, where = source
        return APIError(re.sub(r"^guided_decoding(\.\w+)?", where, message), param=name)

    def check_prompt(
        self, prompt: dict[str, Any], params: SamplingParams, priority: int, prompt_name: str, max_tokens_name: str
    ) -> ProcessedRequest:
        """The prompt checked by the input processor (``params`` are checked already), and
        within the context with its ``max_tokens``: what the engine queues as it is."""
        inputs, max_tokens = self.engine.engine.inputs, params.max_tokens
        try:
            text, token_ids = inputs.truncate(prompt["prompt"], prompt["prompt_token_ids"], params)
        except ValueError as exc:
            raise APIError(str(exc), param="truncate_prompt_tokens") from None
        try:
            token_ids, features = inputs.multimodal(prompt, token_ids, params)  # images: placeholders expanded
            inputs.check_prompt(token_ids)
        except ValueError as exc:
            raise APIError(str(exc), param=prompt_name) from None
        prompt.update(prompt=text, prompt_token_ids=token_ids)  # echo shows what the model read
        limit = self.engine.max_model_len
        if max_tokens is not None and len(token_ids) + max_tokens > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(token_ids) + max_tokens} tokens ({len(token_ids)} in the prompt, {max_tokens} in "
                f"the completion). Reduce the length of the prompt or {max_tokens_name}.",
                param=max_tokens_name,
            )
        return ProcessedRequest(prompt["prompt"], token_ids, params, priority, features)

    # ---- completions ----------------------------------------------------------------------
    async def completion(self, req: CompletionRequest) -> CompletionResponse | StreamingResponse:
        self.check_model(req.model)
        self.check_fields(req, OPENAI_COMPLETION_FIELDS)
        self.check_engine()
        # Off the event loop: tokenizing a long prompt or checking a deep JSON schema took
        # seconds, during which /health and every stream stalled.
        params, prompts, processed = await asyncio.to_thread(self._completion_inputs, req)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            # As in chat: the first chunk goes out with the engine's first output, so that a
            # client-measured TTFT includes the prefill and an error the engine finds first is
            # an HTTP error, not an event after a 200.
            outputs = _merge([
                self.engine.generate(p, params, f"{request_id}-{i}", cache_salt=req.cache_salt)
                for i, p in enumerate(processed)
            ])
            first = await _first_output(outputs)
            return _sse(self._completion_stream(request_id, prompts, params, req, outputs, first))
        finals = await _gather([
            self._final(p, f"{request_id}-{i}", req) for i, p in enumerate(processed)
        ])
        choices, usage = [], _UsageCounter()
        for i, (prompt, out) in enumerate(zip(prompts, finals)):
            usage.add_prompt(out)
            for c in out.outputs:
                usage.completion += _num_completion_tokens(c, req)
                choice = self._completion_choice(i * params.n + c.index, prompt, out, c, req, first=True)
                choice.prompt_logprobs = _prompt_logprobs(out.prompt_logprobs)
                choices.append(choice)
        return CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage.usage())

    def _completion_inputs(
        self, req: CompletionRequest
    ) -> tuple[SamplingParams, list[dict[str, Any]], list[ProcessedRequest]]:
        """The request's parameters and prompts, tokenized and checked (on a worker thread)."""
        if req.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError("best_of other than n is not supported", param="best_of")
        prompt_logprobs = req.prompt_logprobs
        if prompt_logprobs is None and req.echo:
            prompt_logprobs = req.logprobs
        # An explicit null means the default, 16, as in vLLM and OpenAI's completions API (not
        # "up to the context length", which a client could repeat cheaply).
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        if _echo_only(req):  # as vLLM: one token is sampled and left out of the response
            max_tokens = 1
        params = self.sampling_params(
            req, max_tokens=max_tokens, max_tokens_name="max_tokens", logprobs=req.logprobs,
            logprobs_name="logprobs", prompt_logprobs=prompt_logprobs,
        )
        prompts = self._completion_prompts(req.prompt, req.n)
        return params, prompts, [self.check_prompt(p, params, req.priority, "prompt", "max_tokens") for p in prompts]

    def _completion_prompts(self, prompt: str | list, n: int) -> list[dict[str, Any]]:
        if isinstance(prompt, str):
            items: list = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise APIError("prompt must not be empty", param="prompt")
        if len(items) * n > self.max_sequences:  # checked before any prompt is tokenized
            raise APIError(
                f"a request may run at most {self.max_sequences} sequences (prompts x n, the server's "
                f"--max-sequences-per-request), got {len(items)} prompts x n = {n}",
                param="prompt" if len(items) > 1 else "n",
            )
        out = []
        for item in items:
            if isinstance(item, str):
                out.append({"prompt": item, "prompt_token_ids": self.tokenizer.encode(item)})
            else:
                out.append({"prompt": None, "prompt_token_ids": list(item)})
        return out

    def _completion_choice(
        self, index: int, prompt: dict, out: RequestOutput, c: CompletionOutput, req: CompletionRequest, first: bool
    ) -> CompletionChoice:
        """One choice: the completion (after the prompt, with ``echo``, in its ``first`` one);
        ``echo`` with ``max_tokens`` 0 gives the prompt alone."""
        text, token_ids, entries = ("", [], []) if _echo_only(req) else (c.text, c.token_ids, c.logprobs or [])
        echo = req.echo and first
        if echo:
            prompt_text = prompt["prompt"]
            if prompt_text is None:
                prompt_text = self.tokenizer.decode(out.prompt_token_ids)
            text = prompt_text + text
        as_ids, logprobs = bool(req.return_tokens_as_token_ids), None
        if req.logprobs is not None:
            logprobs, offset = CompletionLogprobs(), 0
            if echo:
                prompt_entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
                for token_id, entry in zip(out.prompt_token_ids, prompt_entries):
                    offset = self._add_completion_logprob(logprobs, token_id, entry, req.logprobs, offset, as_ids)
            for token_id, entry in zip(token_ids, entries):
                offset = self._add_completion_logprob(logprobs, token_id, entry, req.logprobs, offset, as_ids)
        return CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason
        )

    def _add_completion_logprob(
        self, acc: CompletionLogprobs, token_id: int, entry: dict[int, Logprob] | None, k: int, offset: int,
        as_ids: bool = False,
    ) -> int:
        """``as_ids``: tokens as ``"token_id:123"`` (vLLM's ``return_tokens_as_token_ids``), which
        any client can map back, where a token's text may be a fragment of a character."""
        if as_ids:
            token = f"token_id:{token_id}"
        elif entry and token_id in entry:
            token = entry[token_id].decoded_token or ""
        else:
            token = self.tokenizer.decode([token_id])
        acc.tokens.append(token)
        acc.text_offset.append(offset)
        if entry is None or token_id not in entry:
            acc.token_logprobs.append(None)
            acc.top_logprobs.append(None)
        else:
            acc.token_logprobs.append(_finite(entry[token_id].logprob))
            top: dict[str, float] = {}
            for tid, lp in _top_items(entry, token_id, k):  # most likely first: it keeps a shared text key
                top.setdefault(f"token_id:{tid}" if as_ids else lp.decoded_token or "", _finite(lp.logprob))
            acc.top_logprobs.append(top)
        return offset + len(token)

    async def _completion_stream(
        self, request_id: str, prompts: list[dict], params: SamplingParams, req: CompletionRequest,
        outputs: AsyncIterator[tuple[int, RequestOutput]], first: tuple[int, RequestOutput],
    ) -> AsyncIterator[str]:
        created, started = int(time.time()), set()
        usage = _UsageCounter()
        per_choice = _ContinuousUsage(req)
        try:
            async with aclosing(outputs):  # closing it aborts what is still running
                async for i, out in _prepend(first, outputs):
                    for c in out.outputs:
                        if not c.token_ids and c.finish_reason is None:
                            # A prefill chunk's prompt logprobs (chunked prefill): they come whole
                            # with the first token, where echo shows them (as vLLM, no empty chunk).
                            continue
                        index = i * params.n + c.index
                        usage.completion += _num_completion_tokens(c, req)
                        choice = self._completion_choice(index, prompts[i], out, c, req, first=index not in started)
                        started.add(index)
                        yield _event(CompletionResponse(
                            id=request_id, created=created, model=self.model_name, choices=[choice],
                            usage=per_choice.add(index, out, _num_completion_tokens(c, req)),
                        ))
                    if out.finished:
                        usage.add_prompt(out)
            if req.stream_options and req.stream_options.include_usage:
                yield _event(CompletionResponse(
                    id=request_id, created=created, model=self.model_name, choices=[], usage=usage.usage()
                ))
        except Exception as exc:  # mid-stream: the status line is gone, say it in the stream
            yield _error_event(self.request_error(exc, req))
        yield "data: [DONE]\n\n"

    # ---- chat completions -----------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest) -> ChatCompletionResponse | StreamingResponse:
        self.check_model(req.model)
        self.check_fields(req, OPENAI_CHAT_FIELDS)
        self.check_engine()
        prompt, tools = await asyncio.to_thread(self._chat_inputs, req)  # off the event loop, as above
        logprobs = prompt.params.logprobs
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            # The first chunk goes out with the first output, as in vLLM: it used to go out
            # before the request reached the engine, so every client-measured TTFT was ~5 ms
            # and an error the engine found came as an event after a 200.
            outputs = self.engine.generate(prompt, prompt.params, request_id, cache_salt=req.cache_salt)
            try:
                first = await outputs.__anext__()
            except BaseException as exc:
                await outputs.aclose()  # aborts it
                error = self.request_error(exc, req)
                if error is exc:
                    raise
                raise error from None
            return _sse(self._chat_stream(request_id, prompt, req, outputs, first, tools))
        out = (await _gather([self._final(prompt, request_id, req)]))[0]
        usage = _UsageCounter()
        usage.add_prompt(out)
        choices = []
        as_ids = bool(req.return_tokens_as_token_ids)
        for c in out.outputs:
            usage.completion += len(c.token_ids)
            message, finish_reason = ChatResponseMessage(content=c.text), c.finish_reason
            if tools is not None:
                message, finish_reason = tools.message(c.text, c.finish_reason)
            choices.append(ChatChoice(
                index=c.index, message=message, logprobs=self._chat_logprobs(c, logprobs, as_ids),
                finish_reason=finish_reason, stop_reason=c.stop_reason,
            ))
        return ChatCompletionResponse(
            id=request_id, model=self.model_name, choices=choices, usage=usage.usage(),
            prompt_logprobs=_prompt_logprobs(out.prompt_logprobs),
        )

    def _chat_inputs(self, req: ChatCompletionRequest) -> tuple[ProcessedRequest, ToolRequest | None]:
        """The request's parameters and rendered prompt, tokenized and checked, and its tool
        calling (on a worker thread)."""
        tools = self.tool_calling.prepare(req)
        max_tokens, max_name = req.max_tokens, "max_tokens"
        if req.max_completion_tokens is not None:
            max_tokens, max_name = req.max_completion_tokens, "max_completion_tokens"
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(
            req, max_tokens=max_tokens, max_tokens_name=max_name, logprobs=logprobs, logprobs_name="top_logprobs",
            tools=tools, prompt_logprobs=req.prompt_logprobs,
        )
        prompt = self._chat_prompt(req, tools.tools if tools else None)
        return self.check_prompt(prompt, params, req.priority, "messages", max_name), tools

    def _chat_prompt(self, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The conversation rendered with the chat template (with ``tools``, and the request's
        ``chat_template_kwargs``), ending in a generation prompt, or, with
        ``continue_final_message``, in the last message left open for the model to continue."""
        if req.chat_template is not None and not self.trust_request_chat_template:
            # A template is code run on the server (Jinja): a nested loop in one stalled it.
            raise APIError(
                "chat_template in a request is refused: start the server with --trust-request-chat-template "
                "to allow it",
                param="chat_template",
            )
        messages, images = [], []
        mm = self.engine.engine.inputs.mm_processor
        for i, m in enumerate(req.messages):
            content, where = m.content, f"messages.{i}.content"
            if isinstance(content, list):
                # Text parts joined, each image part the model's placeholder (a text-only model:
                # a 400); a text that is not a string (a number was once rendered as its digits)
                # is a 400 too.
                try:
                    content, urls = content_parts_to_text(content, mm.placeholder_text if mm else None, where)
                    if len(images) + len(urls) > self.engine.engine.config.image_limit:
                        raise ValueError(
                            f"the messages have more than {self.engine.engine.config.image_limit} images "
                            "(limit_mm_per_prompt)"
                        )
                    images += [self.images.load(url, f"{where} image_url") for url in urls]
                except ValueError as exc:
                    raise APIError(str(exc), param=where) from None
            messages.append(template_message(m, i, {"role": m.role, "content": content or ""}))
        add_generation_prompt = req.add_generation_prompt
        if req.continue_final_message:
            if "add_generation_prompt" in req.model_fields_set and add_generation_prompt:
                raise APIError(  # vLLM's rule: the two contradict each other
                    "continue_final_message and add_generation_prompt cannot both be true",
                    param="continue_final_message",
                )
            add_generation_prompt = False
        template_kwargs = req.chat_template_kwargs or {}
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs))
        if reserved:
            raise APIError(
                f"chat_template_kwargs may not set {', '.join(reserved)} (a request field or the server's)",
                param="chat_template_kwargs",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=req.continue_final_message, chat_template=req.chat_template,
                **({"tools": tools} if tools else {}), **template_kwargs,
            )
        except Exception as exc:
            raise APIError(f"cannot apply the chat template: {exc}", param="messages") from None
        prompt = {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        return prompt

    def _chat_logprobs(self, c: CompletionOutput, k: int | None, as_ids: bool = False) -> ChatLogprobs | None:
        """``as_ids``: every token as ``"token_id:123"`` (``return_tokens_as_token_ids``)."""
        if k is None:
            return None
        content = []
        for token_id, entry in zip(c.token_ids, c.logprobs or []):
            chosen = entry.get(token_id)
            if as_ids:
                token = f"token_id:{token_id}"
            else:
                token = (chosen.decoded_token if chosen else None) or self.tokenizer.decode([token_id])
            top = []
            for tid, lp in _top_items(entry, token_id, k) if k else ():
                text = f"token_id:{tid}" if as_ids else lp.decoded_token or ""
                top.append(TopLogprob(token=text, logprob=_finite(lp.logprob), bytes=list(text.encode())))
            content.append(ChatTokenLogprob(
                token=token, logprob=_finite(chosen.logprob if chosen else -math.inf), bytes=list(token.encode()),
                top_logprobs=top,
            ))
        return ChatLogprobs(content=content)

    async def _chat_stream(
        self, request_id: str, prompt: ProcessedRequest, req: ChatCompletionRequest,
        outputs: AsyncIterator[RequestOutput], first: RequestOutput, tools: ToolRequest | None = None,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        usage = _UsageCounter()

        def chunk(choices: list[ChatStreamChoice], usage_: Usage | None = None) -> str:
            return _event(ChatCompletionChunk(
                id=request_id, created=created, model=self.model_name, choices=choices, usage=usage_
            ))

        params = prompt.params
        logprobs, as_ids = params.logprobs, bool(req.return_tokens_as_token_ids)
        streams = [tools.stream() if tools else None for _ in range(params.n)]
        per_choice = _ContinuousUsage(req)
        try:
            for index in range(params.n):
                yield chunk(
                    [ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))],
                    per_choice.add(index, first, 0),
                )
            async with aclosing(outputs):
                async for out in _prepend(first, outputs):
                    for c in out.outputs:
                        usage.completion += len(c.token_ids)
                        delta, finish_reason = DeltaMessage(content=c.text), c.finish_reason
                        if streams[c.index] is not None:  # tool calls: parsed text, maybe none yet
                            delta, finish_reason = streams[c.index].delta(c.text, c.finish_reason)
                            if delta is None and finish_reason is None and logprobs is None:
                                continue
                        yield chunk([ChatStreamChoice(
                            index=c.index, delta=delta or DeltaMessage(),
                            logprobs=self._chat_logprobs(c, logprobs, as_ids), finish_reason=finish_reason,
                            stop_reason=c.stop_reason,
                        )], per_choice.add(c.index, out, len(c.token_ids)))
                    if out.finished:
                        usage.add_prompt(out)
            if req.stream_options and req.stream_options.include_usage:
                yield chunk([], usage.usage())
        except Exception as exc:
            yield _error_event(self.request_error(exc, req))
        yield "data: [DONE]\n\n"

    # ---- running requests -----------------------------------------------------------------
    async def _final(self, prompt: ProcessedRequest, request_id: str, req: SamplingFields) -> RequestOutput:
        final = None
        try:
            async for out in self.engine.generate(
                prompt, prompt.params, request_id, cache_salt=req.cache_salt, output_kind=OutputKind.FINAL_ONLY,
            ):
                final = out
        except ValueError as exc:
            error = self.request_error(exc, req)
            if error is exc:
                raise
            raise error from None
        if final is None:
            raise APIError("the request was aborted", 500)
        return final


# ---- helpers ----------------------------------------------------------------------------------


def _structured_outputs(so: StructuredOutputs) -> tuple[GuidedDecodingParams, tuple[str, str]]:
    """vLLM's ``structured_outputs`` as pagelm's constraint; its options the backend does not
    take are a 400 naming them rather than ignored."""
    for option in _STRUCTURED_OPTIONS:
        if getattr(so, option) not in (None, False):
            raise APIError(f"structured_outputs.{option} is not supported", param="structured_outputs")
    kinds = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
             "json_object": so.json_object}
    params = GuidedDecodingParams(**{k: v for k, v in kinds.items() if v not in (None, False)})
    return params, ("structured_outputs", f"structured_outputs.{params.kind}")


class _UsageCounter:
    def __init__(self) -> None:
        self.prompt = self.completion = self.cached = 0

    def add_prompt(self, out: RequestOutput) -> None:
        self.prompt += len(out.prompt_token_ids)
        self.cached += out.num_cached_tokens

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt, completion_tokens=self.completion, total_tokens=self.prompt + self.completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached),
        )


def _finite(x: float) -> float:
    # JSON has no -inf; OpenAI-compatible servers report -9999.0 instead.
    return max(x, -9999.0)


def _top_items(entry: dict[int, Logprob], chosen: int, k: int) -> list[tuple[int, Logprob]]:
    """(token id, logprob) of the k most likely tokens of one position (with k = 0: the
    chosen one; with k = -1: every token, the engine having sent the whole vocabulary)."""
    if k == 0:
        return [(chosen, entry[chosen])] if chosen in entry else []
    ranked = sorted(entry.items(), key=lambda item: -item[1].logprob)
    return ranked if k < 0 else ranked[:k]


def _echo_only(req: CompletionRequest) -> bool:
    """``echo`` with ``max_tokens`` 0: the prompt (and its logprobs) alone, as in vLLM."""
    return req.echo and req.max_tokens == 0


def _num_completion_tokens(c: CompletionOutput, req: SamplingFields) -> int:
    """Tokens the response holds for this completion (none when the prompt is echoed alone)."""
    return 0 if isinstance(req, CompletionRequest) and _echo_only(req) else len(c.token_ids)


def _prompt_logprobs(entries: list[dict[int, Logprob] | None] | None) -> list | None:
    """``RequestOutput.prompt_logprobs`` in vLLM's response shape (-inf as -9999, JSON has none)."""
    if entries is None:
        return None
    return [
        None if entry is None else {
            token_id: PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
            for token_id, lp in entry.items()
        }
        for entry in entries
    ]


class _ContinuousUsage:
    """``stream_options.continuous_usage_stats`` (with ``include_usage``, as vLLM): every chunk
    carries the usage of its choice so far; otherwise ``add`` returns None (no usage field)."""

    def __init__(self, req: SamplingFields) -> None:
        options = req.stream_options
        self.on = options is not None and options.include_usage and options.continuous_usage_stats
        self.completion: dict[int, int] = {}

    def add(self, index: int, out: RequestOutput, num_tokens: int) -> Usage | None:
        if not self.on:
            return None
        done = self.completion[index] = self.completion.get(index, 0) + num_tokens
        prompt = len(out.prompt_token_ids)
        return Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)


def _event(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def _error_event(exc: Exception) -> str:
    return f"data: {json.dumps(_as_api_error(exc).body())}\n\n"


def _as_api_error(exc: Exception) -> APIError:
    """What a stream says about an error once its status line is gone."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return APIError(str(exc), 400)
    if isinstance(exc, EngineStepError):
        return APIError(str(exc), 500)
    if isinstance(exc, EngineShuttingDown):
        return APIError(str(exc), 503)
    if isinstance(exc, EngineDeadError):
        return APIError(f"the engine is dead: {exc}", 500)
    return APIError(f"internal error: {exc}", 500)


async def _first_output(outputs: AsyncIterator):
    """The first item of ``outputs``, awaited before a stream's 200 goes out. On failure (or
    when there is none: the request was aborted) ``outputs`` is closed, which aborts its
    requests, and the error raises to the handler as an HTTP error."""
    try:
        return await outputs.__anext__()
    except StopAsyncIteration:
        await outputs.aclose()
        raise APIError("the request was aborted", 500) from None
    except BaseException:
        await outputs.aclose()
        raise


async def _prepend(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for item in rest:
        yield item


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _gather(coros: list) -> list:
    """``asyncio.gather`` that cancels the rest (aborting their requests) when one fails or
    when the caller is cancelled (client gone)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


_DONE = object()


async def _merge(generators: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """Items of several async generators as they come, tagged with the generator's index."""
    if len(generators) == 1:
        async with aclosing(generators[0]) as gen:
            async for item in gen:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def drain(i: int, gen: AsyncIterator) -> None:
        try:
            async with aclosing(gen):
                async for item in gen:
                    queue.put_nowait((i, item))
            queue.put_nowait((i, _DONE))
        except Exception as exc:
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(drain(i, g)) for i, g in enumerate(generators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
