"""The engine core's side of guided decoding: compiles grammars off the step loop, caches
them, and fills the batch's allowed-token bitmask for the runner.

    Scheduler.add_request ── submit(request) ──► cache hit: request.grammar set, admitted now
                                                 miss: compile queued on a worker thread,
                                                       request is WAITING_FOR_GRAMMAR
    Scheduler.schedule    ── poll() ──────────► (compiled: admit, failed or timed out: finish)
    ModelRunner           ── grammar_bitmask(req_ids) ──► int32 CPU [n, ceil(vocab / 32)]
    Scheduler.update_from_output ── accept_tokens(request, sampled)

Sampled tokens reach a grammar in the next ``grammar_bitmask``, which the runner calls after
queuing the forward pass: advancing the matchers and filling the bitmask both happen on the
CPU while the GPU computes, never between two steps.

Compiled grammars are cached by (kind, canonical spec), bounded by their total
``memory_size_bytes``, least recently used evicted first. Requests asking for a constraint
that is already compiling wait on the same compile. A compile that outlives
``structured_output_compile_timeout`` fails the requests waiting on it (it finishes in the
background and is cached, as threads cannot be killed).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagelm.kv_cache import cdiv
from pagelm.structured_output.backend import CompiledGrammar, StructuredOutputBackend

if TYPE_CHECKING:
    from pagelm.config import EngineConfig
    from pagelm.request import Request
    from pagelm.sampling_params import GuidedDecodingParams

logger = logging.getLogger("pagelm")

GrammarKey = tuple[str, str]  # (kind, canonical spec)

_COMPILE_WORKERS = 2


class GrammarCache:
    """Compiled grammars, least recently used first, holding at most ``max_bytes`` in total
    (a grammar larger than that on its own is not kept)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[GrammarKey, CompiledGrammar] = OrderedDict()

    def get(self, key: GrammarKey) -> CompiledGrammar | None:
        compiled = self._entries.get(key)
        if compiled is not None:
            self._entries.move_to_end(key)
        return compiled

    def put(self, key: GrammarKey, compiled: CompiledGrammar) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self._entries[key] = compiled
        self.nbytes += compiled.memory_size_bytes
        while self.nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.memory_size_bytes

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(slots=True)
class _Compile:
    """One constraint being compiled, and the requests waiting for it with their deadlines."""

    future: concurrent.futures.Future
    waiting: list[tuple["Request", float]] = field(default_factory=list)


class StructuredOutputManager:
    def __init__(
        self,
        config: "EngineConfig",
        backend_cls: type[StructuredOutputBackend],
        vocab_size: int,
        eos_token_ids: frozenset[int],
        *,
        pin_memory: bool = False,
    ) -> None:
        self.config = config
        self.backend_cls = backend_cls
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.pin_memory = pin_memory
        self.cache = GrammarCache(config.structured_output_cache_bytes)
        self.timeout = config.structured_output_compile_timeout
        # Guided requests in the engine (waiting for their grammar or running), by id.
        self.requests: dict[str, Request] = {}
        self._compiling: dict[GrammarKey, _Compile] = {}
        # Sampled tokens not yet applied to their request's grammar (see accept_tokens).
        self._unapplied: dict[str, list[int]] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._backend: StructuredOutputBackend | None = None
        self._backend_error: Exception | None = None
        self._backend_lock = threading.Lock()
        self._bitmask: torch.Tensor | None = None

    # ---- the scheduler's side ------------------------------------------------------------
    def submit(self, request: "Request") -> bool:
        """Give ``request`` its grammar now (True: cached) or start compiling it (False: it
        is reported by ``poll`` once compiled, failed or timed out)."""
        params = request.sampling_params.guided_decoding
        assert params is not None, f"{request.request_id} has no guided_decoding"
        self.requests[request.request_id] = request
        key = (params.kind, params.spec)
        compiled = self.cache.get(key)
        if compiled is not None:
            request.grammar = compiled.new_grammar()
            return True
        job = self._compiling.get(key)
        if job is None:
            job = self._compiling[key] = _Compile(self._compile_pool().submit(self._compile, params))
        job.waiting.append((request, time.monotonic() + self.timeout))
        return False

    def poll(self) -> tuple[list["Request"], list["Request"]]:
        """Requests whose grammar is ready (``request.grammar`` set) and requests that failed
        (``request.error`` set) since the last call. A compile counts as timed out for a
        request if it finished after that request's deadline, however late this is called."""
        ready: list[Request] = []
        failed: list[Request] = []
        now = time.monotonic()
        for key, job in list(self._compiling.items()):
            compiled = message = None
            finished_at = now
            if job.future.done():
                del self._compiling[key]
                try:
                    compiled, finished_at = job.future.result()
                except Exception as exc:
                    message = _error_message(exc)
                else:
                    self.cache.put(key, compiled)
            still_waiting = []
            for request, deadline in job.waiting:
                if message is not None:
                    request.error = message
                    failed.append(request)
                elif deadline < finished_at:
                    request.error = (
                        f"guided_decoding: compiling the {key[0]} constraint took longer than "
                        f"structured_output_compile_timeout={self.timeout:g} s (too complex?)"
                    )
                    failed.append(request)
                elif compiled is not None:
                    request.grammar = compiled.new_grammar()
                    ready.append(request)
                else:
                    still_waiting.append((request, deadline))
            job.waiting = still_waiting
        for request in failed:
            self.requests.pop(request.request_id, None)
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until a compile finishes or a deadline passes, for at most ``timeout``
        seconds. Only called when nothing else can run, instead of spinning."""
        if not self._compiling:
            return
        now = time.monotonic()
        deadlines = [d for job in self._compiling.values() for _, d in job.waiting]
        timeout = min([timeout, *(max(d - now, 0.0) for d in deadlines)])
        futures = [job.future for job in self._compiling.values()]
        concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    @property
    def has_pending(self) -> bool:
        """Compiles in flight (``poll`` has something to look at)."""
        return bool(self._compiling)

    @property
    def num_waiting_for_grammar(self) -> int:
        return sum(len(job.waiting) for job in self._compiling.values())

    def accept_tokens(self, request: "Request", token_ids: list[int]) -> None:
        """Tokens ``request`` sampled; its grammar takes them in the next ``grammar_bitmask``
        (a rejected token, which the bitmask rules out, sets ``request.error``)."""
        self._unapplied.setdefault(request.request_id, []).extend(token_ids)

    def release(self, request: "Request") -> None:
        """``request`` left the engine (finished, aborted, or failed)."""
        self._unapplied.pop(request.request_id, None)
        if self.requests.pop(request.request_id, None) is None:
            return
        params = request.sampling_params.guided_decoding
        job = self._compiling.get((params.kind, params.spec))
        if job is not None:  # aborted while its grammar compiled; the compile still gets cached
            job.waiting = [(r, d) for r, d in job.waiting if r is not request]

    # ---- the runner's side ---------------------------------------------------------------
    def grammar_bitmask(self, request_ids: list[str]) -> torch.Tensor:
        """Allowed tokens of each request's next sample: row ``i`` for ``request_ids[i]``,
        int32 on the CPU (pinned on CUDA machines), ``ceil(vocab_size / 32)`` words wide."""
        n = len(request_ids)
        if self._bitmask is None or self._bitmask.shape[0] < n:
            rows = max(n, self.config.max_num_seqs)
            self._bitmask = torch.empty(
                (rows, cdiv(self.vocab_size, 32)), dtype=torch.int32, pin_memory=self.pin_memory
            )
        bitmask = self._bitmask[:n]
        grammars = []
        for req_id in request_ids:
            request = self.requests[req_id]
            tokens = self._unapplied.pop(req_id, None)
            if tokens and not request.grammar.accept_tokens(tokens):
                request.error = f"guided_decoding: sampled token(s) {tokens} are not allowed by the grammar"
            grammars.append(request.grammar)
        self._get_backend().fill_bitmasks(grammars, bitmask)
        return bitmask

    # ---- compiling -----------------------------------------------------------------------
    def _compile_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(_COMPILE_WORKERS, thread_name_prefix="pagelm-grammar")
        return self._executor

    def _compile(self, params: "GuidedDecodingParams") -> tuple[CompiledGrammar, float]:
        """The compiled grammar, and when it was done (``time.monotonic``)."""
        start = time.monotonic()
        compiled = self._get_backend().compile(params)
        done = time.monotonic()
        logger.debug("compiled a %s grammar in %.1f ms", params.kind, (done - start) * 1e3)
        return compiled, done

    def _get_backend(self) -> StructuredOutputBackend:
        """The backend instance, built on first use (loads the tokenizer: worker thread)."""
        if self._backend is not None:
            return self._backend
        with self._backend_lock:
            if self._backend is None and self._backend_error is None:
                try:
                    self._backend = self._make_backend()
                except Exception as exc:
                    self._backend_error = exc
            if self._backend_error is not None:
                raise self._backend_error
            return self._backend

    def _make_backend(self) -> StructuredOutputBackend:
        problems = self.backend_cls.validate(self.config)
        if problems:
            raise ValueError(f"structured_output_backend={self.backend_cls.name!r}: " + "; ".join(problems))
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer or self.config.model)
        return self.backend_cls(self.config, tokenizer, self.vocab_size, self.eos_token_ids)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._backend is not None:
            self._backend.shutdown()


def _error_message(error: BaseException) -> str:
    if isinstance(error, ValueError):
        return str(error)
    return f"guided_decoding: the grammar could not be compiled: {type(error).__name__}: {error}"
