"""The built-in structured-output manager (the core's ``StructuredOutputManager``) for any
``GrammarBackend``: compiles grammars off the step loop, caches them, and fills the batch's
allowed-token bitmask for the runner.

    Scheduler.add_request ── submit(request) ──► cache hit: request.grammar set, admitted now
                                                 miss: compile queued on a worker thread,
                                                       request is WAITING_FOR_GRAMMAR
    Scheduler.schedule    ── poll(timeout) ───► (compiled: admit, failed or timed out: finish)
    ModelRunner           ── grammar_bitmask(req_ids) ──► int32 CPU [n, ceil(vocab / 32)]
    Scheduler.update_from_output ── accept_tokens(request, sampled), then prepare_bitmask()
                                 ── validate_drafts(request, drafts) ──► the prefix it may verify

The grammar work of a step starts as soon as the previous step's tokens are known, on a
worker thread (xgrammar drops the GIL in its batch calls)::

    main:    | prepare | update, outputs, schedule, next step's inputs | grammar_bitmask | forward
    worker:            | accept last tokens, fill next rows |            (joined here)

so it overlaps everything the main thread does up to the sampler (under async scheduling
the sampling of a guided step is queued inside the next step's launch, once that step's
inputs are staged, just before its forward pass). The rows come in the order
the requests sampled in the previous step, which is the next step's order while they decode;
``grammar_bitmask`` fills the rows of requests sampling for the first time (they come last),
and copies the rows into the step's order when it changed (a preemption). Grammars move only
in these jobs, so a staged row stays valid until the next one.

With speculative decoding a guided request verifies drafts too. Its drafts are cut, when
stored, to the longest prefix its grammar allows (``validate_drafts``: a rejected draft could
never be emitted, so neither could the drafts after it), and its ``1 + d`` logits rows are
masked with what the grammar allows after each prefix of the drafts::

    rows of a request verifying d1 d2 | its next token | after d1 | after d1 d2 |
    grammar_bitmask(req_ids, drafts):   staged row       accept d1, fill; accept d2, fill;
                                                         rollback 2

so the grammar is back where it was, and only the tokens the rejection sampler emits are
applied to it (``accept_tokens``). Steps that verify drafts run synchronously: the grammars
are at their request's last token when the rows are filled.

With an offload (``structured_output_process``, the default on CUDA with async scheduling,
for a backend that has one: xgrammar's grammar process), the job goes there instead of the
worker thread: it mirrors each request's grammar (compiling its own copy as the request
arrives) and fills the rows in memory the runner reads, so the step loop never waits for the
GIL on grammar work (on the H100 host that wait made a batch-64 step 15-23% slower). This
side's grammars then fall behind and are caught up (``_catch_up``) only where this side works
on them itself: rows the offload left (a request that arrived before it was ready, a grammar it
is still compiling, a preemption's new order), drafts, or every request once it is gone.

Compiled grammars are cached by (kind, canonical spec), bounded by their total
``memory_size_bytes``, least recently used evicted first. Requests asking for a constraint
that is already compiling wait on the same compile. A compile that outlives
``structured_output_compile_timeout`` fails the requests waiting on it (it finishes in the
background and is cached, as threads cannot be killed).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagelm.plugins.structured_output.cache import GrammarCache, GrammarKey
from pagelm.plugins.structured_output.grammar import CompiledGrammar, GrammarOffload, StructuredOutputGrammar
from pagelm.structured_output import StructuredOutputManager

if TYPE_CHECKING:
    from pagelm.config import EngineConfig
    from pagelm.request import Request
    from pagelm.sampling_params import GuidedDecodingParams

logger = logging.getLogger("pagelm")

_COMPILE_WORKERS = 2
# Fewer guided requests than this advance in grammar_bitmask, after the forward pass is queued:
# a few microseconds each, less than handing them to the worker (wake-ups, GIL hand-offs).
_THREADED_MIN_REQUESTS = 8
# The worker's job runs two xgrammar calls that release the GIL, and needs the GIL back between
# them, while the main thread runs Python (outputs, the next schedule): at CPython's default
# switch interval (5 ms, longer than a decode step) it would get it only when the main thread
# blocks. The job's start does not wait on it: ``prepare_bitmask`` blocks until the job runs.
_SWITCH_INTERVAL_S = 5e-5


@dataclass(slots=True)
class _Compile:
    """One constraint being compiled, and the requests waiting for it with their deadlines."""

    future: concurrent.futures.Future
    waiting: list[tuple["Request", float]] = field(default_factory=list)


class GrammarManager(StructuredOutputManager):
    """Runs a ``GrammarBackend`` for the engine core (built by ``GrammarBackend.make_manager``;
    ``backend_cls`` is that class: not imported here, as its module imports this one)."""

    def __init__(
        self,
        config: "EngineConfig",
        backend_cls: type,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        *,
        pin_memory: bool = False,
        grammar_process: bool = False,
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
        self._backend = None  # the GrammarBackend instance, built on first use
        self._backend_error: Exception | None = None
        self._backend_lock = threading.Lock()
        # The step-ahead work (prepare_bitmask): one thread, the job in flight, and the
        # requests whose rows of ``_staged`` are filled, in row order.
        self._bitmask_worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._job: concurrent.futures.Future | None = None
        self._staged_ids: list[str] = []
        self._staged: torch.Tensor | None = None
        self._ordered: torch.Tensor | None = None  # the step's order, when staged rows are not
        self._drafted: torch.Tensor | None = None  # rows of a step verifying drafts (1 + d each)
        # The offload (grammar_process=True and the backend has one), started with the first
        # guided request: the slots of the requests it mirrors, and the tokens it applied that
        # this side's grammars have not yet (``_catch_up`` applies them where this side needs
        # its own).
        self.use_grammar_process = grammar_process
        self._process: GrammarOffload | None = None
        self._slots: dict[str, int] = {}
        self._next_slot = itertools.count()
        self._lag: dict[str, list[int]] = {}
        self.rows_filled_by_process = 0  # a count, for tests and benchmarks

    # ---- the scheduler's side ------------------------------------------------------------
    def submit(self, request: "Request") -> bool:
        """Give ``request`` its grammar now (True: cached) or start compiling it (False: it
        is reported by ``poll`` once compiled, failed or timed out)."""
        params = request.sampling_params.guided_decoding
        assert params is not None, f"{request.request_id} has no guided_decoding"
        self.requests[request.request_id] = request
        if self.use_grammar_process and self._grammar_process() is not None and self._process.wait_ready(0):
            slot = self._slots[request.request_id] = next(self._next_slot)
            self._process.add(slot, params)  # compiles there alongside the compile here
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

    def poll(self, timeout: float = 0.0) -> tuple[list["Request"], list["Request"]]:
        """Requests whose grammar is ready (``request.grammar`` set) and requests that failed
        (``request.error`` set) since the last call, after waiting up to ``timeout`` seconds
        for a compile to finish or a deadline to pass. A compile counts as timed out for a
        request if it finished after that request's deadline, however late this is called."""
        if timeout > 0:
            self._wait(timeout)
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

    def _wait(self, timeout: float) -> None:
        """Block until a compile finishes or a deadline passes, for at most ``timeout``
        seconds (the engine has nothing else to do)."""
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
        """Tokens ``request`` sampled; its grammar takes them in the next ``prepare_bitmask``
        (a rejected token, which the bitmask rules out, sets ``request.error``)."""
        self._unapplied.setdefault(request.request_id, []).extend(token_ids)

    def validate_drafts(self, request: "Request", drafts: list[int]) -> list[int]:
        """The drafts ``request`` may verify: the longest prefix of ``drafts`` its grammar
        allows after every token it sampled (applied or not yet), the grammar left as it was.
        A stop token (EOS) is cut too: it ends the grammar, so the row after it would allow
        nothing, and the row before it allows it where the grammar may end, so the target
        samples it there itself (and a guided request's EOS only ever comes last)."""
        if not self.eos_token_ids.isdisjoint(drafts):
            drafts = list(itertools.takewhile(lambda token: token not in self.eos_token_ids, drafts))
        self._finish_job()  # a job in flight may hold this grammar
        self._catch_up(request)
        if request.error is not None:
            return []
        pending = self._unapplied.get(request.request_id, [])
        n = request.grammar.validate_tokens([*pending, *drafts]) - len(pending)
        return drafts[: max(n, 0)]

    def release(self, request: "Request") -> None:
        """``request`` left the engine (finished, aborted, or failed)."""
        self._unapplied.pop(request.request_id, None)
        self._lag.pop(request.request_id, None)
        slot = self._slots.pop(request.request_id, None)
        if slot is not None:
            self._process.release(slot)
        if self.requests.pop(request.request_id, None) is None:
            return
        params = request.sampling_params.guided_decoding
        job = self._compiling.get((params.kind, params.spec))
        if job is not None:  # aborted while its grammar compiled; the compile still gets cached
            job.waiting = [(r, d) for r, d in job.waiting if r is not request]

    # ---- the step loop's side ------------------------------------------------------------
    def prepare_bitmask(self) -> None:
        """Start advancing each grammar by the tokens accepted this step and filling its row of
        the next step's bitmask, in the grammar process or on a worker thread;
        ``grammar_bitmask`` picks the rows up.
        The step loop calls it once the step's tokens are known. Until then the worker owns
        those requests' grammars. A few requests are left to ``grammar_bitmask``: their work
        costs less than the hand-off."""
        self._finish_job()
        if self._process is not None and self._unapplied and self._process.wait_ready(0):
            self._job = self._process_step()
        elif len(self._unapplied) >= _THREADED_MIN_REQUESTS:
            if self._bitmask_worker is None:
                self._bitmask_worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagelm-bitmask")
                sys.setswitchinterval(min(sys.getswitchinterval(), _SWITCH_INTERVAL_S))
            # Wait the few microseconds until the worker holds the job: left to take the GIL
            # from the main thread's Python, it started 0.44 ms later (H100 host, batch 64).
            started = threading.Event()
            self._job = self._bitmask_worker.submit(self._advance_and_fill, *self._stage(), started)
            started.wait()

    # ---- the runner's side ---------------------------------------------------------------
    def grammar_bitmask(self, request_ids: list[str], drafts: list[Sequence[int]] | None = None) -> torch.Tensor:
        """Allowed tokens of each request's next sample: row ``i`` for ``request_ids[i]``,
        int32 on the CPU (pinned on CUDA machines), ``ceil(vocab_size / 32)`` words wide.
        With ``drafts`` (``drafts[i]``: the drafts ``request_ids[i]`` verifies, all allowed by
        ``validate_drafts``) request ``i`` owns ``1 + len(drafts[i])`` consecutive rows, the
        ``j``-th of them allowing what may follow its first ``j`` drafts.
        The runner must be done reading it (copied to the device, synced) by the step's end."""
        bitmask = self._next_token_rows(request_ids)
        if drafts is None or not any(drafts):
            return bitmask
        return self._with_draft_rows(request_ids, drafts, bitmask)

    def _next_token_rows(self, request_ids: list[str]) -> torch.Tensor:
        """``grammar_bitmask`` without drafts: the staged rows, in ``request_ids``' order."""
        self._finish_job()
        if self._unapplied:  # a few requests, or the step loop did not prepare: do it now
            self._take(self._advance_and_fill(*self._stage()))
        n, staged = len(request_ids), self._staged_ids
        ready = min(n, len(staged))
        if staged[:ready] == request_ids[:ready] and (ready == 0 or self._staged.shape[0] >= n):
            # The usual step: the decoding requests' rows are ready and in order; requests
            # sampling for the first time (their prefill done) come after them.
            self._staged = self._rows_buffer(self._staged, n)  # grows only when nothing is staged
            self._staged_ids = list(request_ids) if n > ready else staged
            bitmask, missing = self._staged[:n], list(range(ready, n))
        else:  # the order changed (a preemption, a prefill that finished mid-queue): copy
            self._ordered = self._rows_buffer(self._ordered, n)
            bitmask, missing = self._ordered[:n], []
            staged_row = {req_id: row for row, req_id in enumerate(staged)}
            src, dst = [], []
            for i, req_id in enumerate(request_ids):
                row = staged_row.get(req_id)
                if row is None:
                    missing.append(i)
                else:
                    src.append(row)
                    dst.append(i)
            if src:
                bitmask[dst] = self._staged[src]
        # With async scheduling a request may have finished (and released its grammar) since
        # this step was scheduled: its sample will be discarded, any token will do.
        gone = [i for i in missing if request_ids[i] not in self.requests]
        if gone:
            bitmask[gone] = -1
            missing = [i for i in missing if request_ids[i] in self.requests]
        if missing:
            self._fill_here([self.requests[request_ids[i]] for i in missing], bitmask, missing)
        return bitmask

    def _with_draft_rows(
        self, request_ids: list[str], drafts: list[Sequence[int]], first_rows: torch.Tensor
    ) -> torch.Tensor:
        """``first_rows`` spread out to ``1 + len(drafts[i])`` rows per request, the others
        filled one draft position at a time, over all the requests that have one there (two
        batch calls per position), then every grammar rolled back over its drafts."""
        starts = [0, *itertools.accumulate(1 + len(d) for d in drafts)]
        self._drafted = self._rows_buffer(self._drafted, starts[-1])
        bitmask = self._drafted[: starts[-1]]
        bitmask[starts[:-1]] = first_rows
        backend = self._get_backend()
        grammars: dict[int, StructuredOutputGrammar] = {}
        for i, (req_id, d) in enumerate(zip(request_ids, drafts)):
            if d and req_id in self.requests:
                self._catch_up(self.requests[req_id])
                grammars[i] = self.requests[req_id].grammar
            elif d:  # finished since it was scheduled (async scheduling): samples discarded
                bitmask[starts[i] + 1 : starts[i + 1]] = -1
        moved = dict.fromkeys(grammars, 0)
        walking = list(grammars)
        for j in range(max(len(d) for d in drafts)):
            walking = [i for i in walking if j < len(drafts[i])]
            if not walking:
                break
            accepted = backend.batch_accept_tokens([grammars[i] for i in walking], [[drafts[i][j]] for i in walking])
            # Drafts not validated (a bug upstream, not a crash): a rejected draft is ruled out
            # by the row before it, a stop token ends the request; the rows after either are
            # never emitted.
            still = []
            for i, ok in zip(walking, accepted):
                moved[i] += ok
                if ok and drafts[i][j] not in self.eos_token_ids:
                    still.append(i)
                else:
                    bitmask[starts[i] + j + 1 : starts[i + 1]] = -1
            walking = still
            if not walking:
                break
            backend.fill_bitmasks([grammars[i] for i in walking], bitmask, rows=[starts[i] + j + 1 for i in walking])
        for i, n in moved.items():
            if n:
                grammars[i].rollback(n)
        return bitmask

    # ---- the grammar process -------------------------------------------------------------
    def wait_for_grammar_process(self, timeout: float) -> bool:
        """Start the offload if it is not running and wait up to ``timeout`` seconds until it
        takes requests (guided requests that arrive before that are never handed to it). For
        benchmarks and tests; False without one."""
        return self.use_grammar_process and self._grammar_process() is not None and self._process.wait_ready(timeout)

    def _grammar_process(self) -> GrammarOffload | None:
        if self._process is None and self.use_grammar_process:
            self._process = self.backend_cls.offload(
                self.config, self.vocab_size, self.eos_token_ids, max(self.config.max_num_seqs, 1),
                pin_memory=self.pin_memory,
            )
            if self._process is None:  # the backend has none: the worker thread does it
                logger.info("structured_output_backend=%r has no grammar process", self.backend_cls.name)
                self.use_grammar_process = False
        return self._process

    def _process_step(self) -> "_PendingStep":
        """Send this step's tokens to the grammar process; every request's tokens wait in
        ``_lag`` until this side needs its own grammar (a row the process leaves)."""
        requests, tokens, _ = self._take_unapplied(self._process.bitmask)
        for request, toks in zip(requests, tokens):
            self._lag.setdefault(request.request_id, []).extend(toks)
        self._process.step([self._slots.get(r.request_id, -1) for r in requests], tokens)
        return _PendingStep(lambda: self._process_result(requests, tokens))

    def _process_result(self, requests: list["Request"], tokens: list[list[int]]):
        """The job's result (``_take``) from the process's reply; the rows it left are filled
        here, from this side's grammars brought up to date."""
        unfilled, rejected_rows = self._process.result()
        rows = range(len(requests)) if unfilled is None else unfilled
        rejected = [(requests[row], tokens[row]) for row in rejected_rows]
        self.rows_filled_by_process += len(requests) - len(rows)
        if rows:
            self._fill_here([requests[row] for row in rows], self._staged, list(rows))
        return [r.request_id for r in requests], rejected

    def _fill_here(self, requests: list["Request"], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill ``rows`` of ``bitmask`` from this side's grammars (brought up to date first)."""
        for request in requests:
            self._catch_up(request)
        self._get_backend().fill_bitmasks([r.grammar for r in requests], bitmask, rows=rows)

    def _catch_up(self, request: "Request") -> None:
        """Apply to ``request``'s grammar the tokens only the grammar process has applied (a
        rejected token fails the request, as in the worker's job)."""
        lag = self._lag.pop(request.request_id, None)
        if lag:
            if not request.grammar.accept_tokens(lag) and request.error is None:
                request.error = self._rejection(request, lag)

    # ---- the worker ----------------------------------------------------------------------
    def _stage(self) -> tuple[list["Request"], list[list[int]], torch.Tensor]:
        """A job's arguments: the unapplied tokens, their requests, the buffer their rows go
        to (no row is valid until the job is done)."""
        requests, tokens, buffer = self._take_unapplied()
        if self._lag:  # the grammar process stopped: this side takes over from where it was
            for request in requests:
                self._catch_up(request)
        return requests, tokens, buffer

    def _take_unapplied(
        self, buffer: torch.Tensor | None = None
    ) -> tuple[list["Request"], list[list[int]], torch.Tensor]:
        """The unapplied tokens and their requests, handed to a job whose rows go to
        ``buffer`` (default: the staging buffer, grown to fit); nothing is staged until then."""
        requests = [self.requests[req_id] for req_id in self._unapplied]
        tokens = list(self._unapplied.values())
        self._unapplied = {}
        self._staged_ids = []
        self._staged = self._rows_buffer(self._staged, len(requests)) if buffer is None else buffer
        return requests, tokens, self._staged

    def _advance_and_fill(
        self, requests: list["Request"], tokens: list[list[int]], bitmask: torch.Tensor,
        started: threading.Event | None = None,
    ):
        """The job: advance the grammars, fill their rows. Returns the ids of the rows filled,
        and the requests whose grammar rejected their tokens, with them. ``started`` is set
        just before the first xgrammar call, which lets the main thread have the GIL back."""
        try:
            backend = self._get_backend()
            grammars = [r.grammar for r in requests]
        finally:  # also if that failed: the main thread waits for it
            if started is not None:
                started.set()
        accepted = backend.batch_accept_tokens(grammars, tokens)
        backend.fill_bitmasks(grammars, bitmask)
        rejected = [(r, t) for r, t, ok in zip(requests, tokens, accepted) if not ok]
        return [r.request_id for r in requests], rejected

    def _finish_job(self) -> None:
        """Wait for the job in flight; a rejected token fails its request (the bitmask rules
        it out, so only a backend bug gets here)."""
        job, self._job = self._job, None
        if job is not None:
            self._take(job.result())

    def _take(self, result: tuple[list[str], list[tuple["Request", list[int]]]]) -> None:
        self._staged_ids, rejected = result
        for request, token_ids in rejected:
            request.error = self._rejection(request, token_ids)

    def _rejection(self, request: "Request", token_ids: list[int]) -> str:
        """Why ``request``'s grammar rejected its sampled tokens. A grammar that allows no
        token at all (a JSON schema whose ``$ref`` loops on itself matches no text) leaves
        every logit masked, so whatever was sampled is rejected: say that, not "token 0"."""
        row = torch.zeros((1, _words(self.vocab_size)), dtype=torch.int32)
        request.grammar.fill_bitmask(row, 0)
        if not bool(row.any()):
            return "guided_decoding: the output constraint allows no token here (it matches no text)"
        return f"guided_decoding: sampled token(s) {token_ids} are not allowed by the grammar"

    def _rows_buffer(self, buffer: torch.Tensor | None, n: int) -> torch.Tensor:
        """A persistent ``[rows, words]`` bitmask with at least ``n`` rows."""
        if buffer is None or buffer.shape[0] < n:
            rows = max(n, self.config.max_num_seqs)
            with torch.inference_mode(False):  # a plain tensor: the worker thread writes it too
                buffer = torch.empty((rows, _words(self.vocab_size)), dtype=torch.int32, pin_memory=self.pin_memory)
        return buffer

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

    def _get_backend(self):
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

    def _make_backend(self):
        return self.backend_cls.build(self.config, self.vocab_size, self.eos_token_ids)

    def shutdown(self) -> None:
        if self._process is not None:
            self._finish_job()
            self._process.close()
        if self._bitmask_worker is not None:
            self._bitmask_worker.shutdown(wait=True)
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._backend is not None:
            self._backend.shutdown()


class _PendingStep:
    """A step handed to the grammar process, like a worker job's future: ``result()``."""

    __slots__ = ("result",)

    def __init__(self, result) -> None:
        self.result = result


def _words(vocab_size: int) -> int:
    """Bitmask words per row: 32 tokens each."""
    return -(-vocab_size // 32)


def _error_message(error: BaseException) -> str:
    if isinstance(error, ValueError):
        return str(error)
    return f"guided_decoding: the grammar could not be compiled: {type(error).__name__}: {error}"
