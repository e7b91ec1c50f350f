"""LLMEngine: text in, text out around an ``EngineCore``. It validates and tokenizes
prompts, fans ``n > 1`` out into child requests, runs steps, and turns core outputs into
``RequestOutput``s. ``LLM`` (offline) and the async engine both drive one of these."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Union

from transformers import AutoTokenizer

from pagelm.config import EngineConfig
from pagelm.engine.engine_core import EngineCore
from pagelm.hub import resolve_model
from pagelm.engine.output_processor import OutputKind, OutputProcessor, ParentRequest, RequestState
from pagelm.outputs import RequestOutput
from pagelm.request import Request
from pagelm.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from pagelm.structured_output import validate_guided_decoding

# vLLM's prompt shapes: a string, or {"prompt_token_ids": [...]} (TokensPrompt), or
# {"prompt": "..."} (TextPrompt).
PromptType = Union[str, dict[str, Any]]


def load_eos_token_ids(model_dir: Path, tokenizer) -> frozenset[int]:
    """EOS ids from generation_config.json (int or list), else config.json, else tokenizer
    (when there is one)."""
    for name in ("generation_config.json", "config.json"):
        f = model_dir / name
        if f.exists():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return frozenset([eos] if isinstance(eos, int) else eos)
    if tokenizer is None or tokenizer.eos_token_id is None:
        return frozenset()
    return frozenset([tokenizer.eos_token_id])


class LLMEngine:
    """``core_factory(config, eos_token_ids)`` builds the engine core: ``EngineCore`` itself
    (offline), or a client of one running in a thread or another process (``AsyncLLM``)."""

    def __init__(self, config: EngineConfig, core_factory: Callable[..., Any] = EngineCore) -> None:
        self.config = config
        if not Path(config.model).expanduser().is_dir():
            # A hub id becomes its local snapshot; anything else fails here at once, not after
            # the tokenizer's ~50 s of hub retries.
            config.model = resolve_model(config.model)
        model_dir = Path(config.model).expanduser()
        self.tokenizer = (
            None if config.skip_tokenizer_init else AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        )
        eos = load_eos_token_ids(model_dir, self.tokenizer) if model_dir.is_dir() else frozenset()
        self.core = core_factory(config, eos)
        self.max_model_len = self.core.max_model_len
        self.vocab_size = self.core.vocab_size
        self.output_processor = OutputProcessor()

    # ---- input processing ----------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt" in prompt):
            text = prompt if isinstance(prompt, str) else prompt["prompt"]
            if self.tokenizer is None:
                raise ValueError("skip_tokenizer_init=True: prompts must be {'prompt_token_ids': [...]}, not text")
            return text, self.tokenizer.encode(text)
        raise ValueError(
            "prompt must be a string, {'prompt': str} or {'prompt_token_ids': list[int]}, "
            f"got {type(prompt).__name__}"
        )

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt must contain at least one token")
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids contains {bad!r}, outside the vocabulary [0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; with max_model_len={self.max_model_len} it must "
                f"have at most {self.max_model_len - 1} so one token can be generated"
            )

    @property
    def max_logprobs(self) -> int:
        """The most ``logprobs`` / ``prompt_logprobs`` a request may ask for: the config's
        ``max_logprobs`` (-1: no limit of its own), never beyond the vocabulary, whose size a
        top-k cannot exceed (it raised in the step, failing every request in it)."""
        limit = self.config.max_logprobs
        return self.vocab_size if limit < 0 else min(limit, self.vocab_size)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        output_kind: OutputKind = OutputKind.FINAL_ONLY,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue one prompt (``params.n`` samples of it), whole or not at all: bad input raises
        ``ValueError`` before the first sample is queued, and a sample the core still refuses
        (it could not be sent, say) takes the ones queued before it back out."""
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids)
        self.validate_params(params, priority)
        arrival_time = time.time() if arrival_time is None else arrival_time
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        parent = ParentRequest(request_id, params.n) if params.n > 1 else None
        children = []
        for index in range(params.n):
            child_id = f"{index}_{request_id}" if parent else request_id
            child_params = params if parent is None else child_sampling_params(params, index)
            state = RequestState(
                child_id, text, token_ids, child_params, self.tokenizer, output_kind,
                arrival_time, parent=parent, index=index,
            )
            request = Request(
                child_id, token_ids, child_params, eos_token_ids=self.core.eos_token_ids,
                arrival_time=arrival_time, priority=priority, cache_salt=cache_salt,
                max_tokens=max_tokens,
            )
            children.append((state, request))
        self._check_ids_free([request_id] + [request.request_id for _, request in children])
        queued: list[str] = []
        try:
            for state, request in children:
                self.core.add_request(request)
                queued.append(request.request_id)
                self.output_processor.add_request(state)
        except Exception:
            self.abort_request(queued)
            raise

    def validate_params(self, params: SamplingParams, priority: int) -> None:
        """What ``SamplingParams`` cannot check alone: limits of this engine and its model."""
        if isinstance(priority, bool) or not isinstance(priority, int) or not INT64_MIN <= priority <= INT64_MAX:
            raise ValueError(f"priority must be an integer in [{INT64_MIN}, {INT64_MAX}], got {priority!r}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; with skip_tokenizer_init=True use stop_token_ids")
        vocab_bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if vocab_bad:
            raise ValueError(f"stop_token_ids {vocab_bad} are outside the vocabulary [0, {self.vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            wanted = getattr(params, name)
            if wanted is not None and wanted > self.max_logprobs:
                raise ValueError(
                    f"{name} must be at most {self.max_logprobs} (the engine's max_logprobs), got {wanted}"
                )
        if params.guided_decoding is not None:
            validate_guided_decoding(self.config, params.guided_decoding)

    def _check_ids_free(self, request_ids: list[str]) -> None:
        # A second request under a live id would take over the first one's outputs.
        processor = self.output_processor
        busy = [i for i in request_ids if i in processor.states or i in processor.parent_children]
        if busy:
            raise ValueError(f"request_id {busy[0]!r} is already in use")

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Abort requests; the id of an ``n > 1`` request aborts all its children."""
        ids = self.output_processor.expand_ids(request_ids)
        self.core.abort_requests(ids)
        self.output_processor.abort(ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outputs = self.core.step()
        results, stopped = self.output_processor.process_outputs(outputs)
        if stopped:
            self.core.finish_by_stop_string(stopped)
        return results

    def shutdown(self) -> None:
        self.core.shutdown()


def child_sampling_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample ``index`` of an ``n > 1`` request: one sample, seeded ``seed + index`` wrapped
    into int64 so that every child's seed crosses the engine-core wire (seed = 2**63 - 1 with
    n = 2 gave the second child 2**63, which the engine core refused)."""
    child = params.clone()
    child.n = 1
    if params.seed is not None:
        child.seed = (params.seed + index - INT64_MIN) % 2**64 + INT64_MIN
    return child
