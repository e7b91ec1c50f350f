"""LLMEngine: text in, text out around an ``EngineCore``. Its input processor validates and
tokenizes prompts; it fans ``n > 1`` out into child requests, runs steps, and turns core
outputs into ``RequestOutput``s. ``LLM`` (offline) and the async engine both drive one of these."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from pagelm.config import EngineConfig
from pagelm.engine.engine_core import EngineCore
from pagelm.engine.input_processor import InputProcessor, ProcessedRequest, PromptType
from pagelm.engine.output_processor import OutputKind, OutputProcessor, ParentRequest, RequestState
from pagelm.multimodal import MultiModalProcessor, SupportsMultiModal
from pagelm.outputs import RequestOutput
from pagelm.plugin_manager import get_plugin_manager
from pagelm.request import Request
from pagelm.sampling_params import INT64_MIN, SamplingParams


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
    (offline), or a client of one running in a thread or another process (``AsyncLLM``);
    with data parallelism, ``data_parallel_size`` of them behind the data-parallel plugin."""

    def __init__(self, config: EngineConfig, core_factory: Callable[..., Any] = EngineCore) -> None:
        self.config = config
        if not Path(config.model).expanduser().is_dir():
            # A hub id becomes its local snapshot; anything else fails here at once, not after
            # the tokenizer's ~50 s of hub retries.
            config.model = get_plugin_manager().collect("model loader").get(config.load_format).resolve(config.model)
        model_dir = Path(config.model).expanduser()
        self.tokenizer = (
            None if config.skip_tokenizer_init
            else AutoTokenizer.from_pretrained(config.tokenizer or config.model, trust_remote_code=config.trust_remote_code)
        )
        eos = load_eos_token_ids(model_dir, self.tokenizer) if model_dir.is_dir() else frozenset()
        self.core_factory, self.eos_token_ids = core_factory, eos
        self.core = self._make_core()
        self.max_model_len = self.core.max_model_len
        self.vocab_size = self.core.vocab_size
        self.output_processor = OutputProcessor()
        self.inputs = InputProcessor(
            config, self.tokenizer, self.vocab_size, self.max_model_len, self._mm_processor(model_dir)
        )

    def _mm_processor(self, model_dir: Path) -> MultiModalProcessor | None:
        """A vision-language model's processor, made from its model directory (None: the
        architecture takes no images). Looked up in the model registry: the model's class
        names its processor."""
        if not (model_dir / "config.json").is_file():
            return None
        hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=self.config.trust_remote_code)
        registry = get_plugin_manager().collect("model architecture")
        for arch in getattr(hf_config, "architectures", None) or []:
            if arch in registry:
                cls = registry.get(arch)
                if isinstance(cls, type) and issubclass(cls, SupportsMultiModal):
                    return cls.multimodal_processor(model_dir, hf_config, self.tokenizer)
                return None
        return None

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, *,
        output_kind: OutputKind = OutputKind.FINAL_ONLY, priority: int = 0, cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue one prompt (``params.n`` samples of it): checked and tokenized by the input
        processor (``ValueError`` before anything is queued), then ``add_processed``."""
        processed = self.inputs.process(prompt, params, priority)
        self.add_processed(request_id, processed, output_kind=output_kind, cache_salt=cache_salt, arrival_time=arrival_time)

    def add_processed(
        self, request_id: str, processed: ProcessedRequest, *, output_kind: OutputKind = OutputKind.FINAL_ONLY,
        cache_salt: str | None = None, arrival_time: float | None = None,
    ) -> None:
        """Queue a request the input processor has checked, whole or not at all: a sample the
        core still refuses takes the ones queued before it back out."""
        text, token_ids, params = processed.text, processed.token_ids, processed.params
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
                arrival_time=arrival_time, priority=processed.priority, cache_salt=cache_salt,
                max_tokens=max_tokens, mm_features=list(processed.mm_features),
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

    def _check_ids_free(self, request_ids: list[str]) -> None:
        # A second request under a live id would take over the first one's outputs.
        processor = self.output_processor
        busy = [i for i in request_ids if i in processor.states or i in processor.parent_children]
        if busy:
            raise ValueError(f"request_id {busy[0]!r} is already in use")

    def abort_request(self, request_ids: Iterable[str]) -> list[str]:
        """Abort requests; the id of an ``n > 1`` request aborts all its children. Returns
        the ids of the requests (children) that were still running."""
        ids = self.output_processor.abort(request_ids)
        self.core.abort_requests(ids)
        return ids

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outputs = self.core.step()
        results, stopped = self.output_processor.process_outputs(outputs)
        if stopped:
            self.core.finish_by_stop_string(stopped)
        return results

    def restart_core(self) -> None:
        """Replace a dead engine core with a fresh one (its requests are gone with it: the
        caller has failed them). Blocks while the new core loads the model."""
        self.core.shutdown()  # reaps the dead process
        self.output_processor = OutputProcessor()
        self.core = self._make_core()

    def _make_core(self):
        """One engine core, or ``data_parallel_size`` of them behind the data-parallel plugin."""
        if self.config.data_parallel_size == 1:
            return self.core_factory(self.config, self.eos_token_ids)
        registry = get_plugin_manager().collect("data parallel")
        if len(registry) != 1:
            raise ValueError(
                f"data_parallel_size={self.config.data_parallel_size} needs exactly one data-parallel plugin; "
                f"registered: {', '.join(registry.names()) or '(none: is data_parallel in PAGELM_DISABLE_PLUGINS?)'}"
            )
        return registry.get(registry.names()[0])(self.config, self.eos_token_ids, self.core_factory)

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
