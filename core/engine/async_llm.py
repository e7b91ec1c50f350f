"""AsyncLLM: many concurrent ``generate()`` streams over one engine core (continuous batching
across clients). Requests join and leave at any step.

    event loop (API process)                              engine core (own process or thread)
    generate() -> LLMEngine.add_request ---- add ------->  busy loop: commands, step(), publish
    _output_loop <- get_output() <--------- outputs -----
      OutputProcessor: detokenize, stop strings
      -> _Stream of each request -> the generate() that awaits it

Tokenizing and detokenizing stay in the API process; the engine core only sees token ids.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from pagelm.config import EngineConfig
from pagelm.engine.core_client import EngineDeadError, EngineShuttingDown, InprocCoreClient, MPCoreClient
from pagelm.engine.core_loop import SchedulerStats, freeze_heap, thaw_heap
from pagelm.engine.core_output import ENGINE_FAULT, EngineStepError
from pagelm.engine.input_processor import ProcessedRequest, PromptType
from pagelm.engine.iteration_stats import IterationStats
from pagelm.engine.llm_engine import LLMEngine
from pagelm.engine.output_processor import OutputKind
from pagelm.outputs import RequestOutput
from pagelm.plugin_manager import get_plugin_manager
from pagelm.sampling_params import SamplingParams

logger = logging.getLogger("pagelm")

__all__ = ["AsyncLLM", "EngineDeadError"]


class _Stream:
    """One request's outputs waiting for its consumer. A consumer that falls behind gets the
    deltas merged into one output instead of a growing queue."""

    __slots__ = ("pending", "error", "event")

    def __init__(self) -> None:
        self.pending: RequestOutput | None = None
        self.error: BaseException | None = None
        self.event = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        if self.pending is None:
            self.pending = out
            self.event.set()
        else:
            _merge_delta(self.pending, out)

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()

    async def get(self) -> RequestOutput:
        while self.pending is None:
            if self.error is not None:
                raise self.error
            self.event.clear()
            await self.event.wait()
        out, self.pending = self.pending, None
        return out


def _merge_delta(acc: RequestOutput, new: RequestOutput) -> None:
    for c in new.outputs:
        prev = next((p for p in acc.outputs if p.index == c.index), None)
        if prev is None:
            acc.outputs.append(c)
            continue
        prev.text += c.text
        prev.token_ids = prev.token_ids + c.token_ids
        if c.logprobs is not None:
            prev.logprobs = (prev.logprobs or []) + c.logprobs
        prev.cumulative_logprob = c.cumulative_logprob
        prev.finish_reason, prev.stop_reason = c.finish_reason, c.stop_reason
    acc.finished = new.finished
    acc.error = acc.error or new.error
    acc.metrics = new.metrics
    acc.num_cached_tokens = new.num_cached_tokens


class _Aborted(Exception):
    """Ends a stream whose request was aborted through ``AsyncLLM.abort``."""


class AsyncLLM:
    """The async engine. ``engine_process=True`` runs the engine core in its own process
    (the default for serving); ``False`` runs it in a thread of this process."""

    def __init__(
        self, config: EngineConfig, *, engine_process: bool = True, model_name: str | None = None,
        log_stats_interval: float | None = 10.0, max_engine_restarts: int = 3,
    ) -> None:
        self.config = config
        self.engine = LLMEngine(config, core_factory=MPCoreClient if engine_process else InprocCoreClient)
        self.core = self.engine.core
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.model_name = model_name or config.model
        self.stats = SchedulerStats(num_free_blocks=self.core.num_kv_blocks, num_kv_blocks=self.core.num_kv_blocks)
        # Every registered stat logger, by name (the server's /metrics reads prometheus's
        # registry). One that fails to start fails the engine's, without leaving a core running.
        try:
            registry = get_plugin_manager().collect("stat logger")
            self.stat_loggers = {
                name: registry.get(name)(config, self.model_name, self.max_model_len, self.stats)
                for name in registry.names()
            }
        except BaseException:
            self.core.shutdown()
            raise
        self.log_stats_interval = log_stats_interval
        self.dead_error: EngineDeadError | None = None
        self.max_engine_restarts = max_engine_restarts  # a dead core is replaced this many times
        self.num_engine_restarts = 0
        self.draining = False  # begin_drain: running requests go on, new ones are refused
        self._streams: dict[str, _Stream] = {}
        self._started: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []
        self._froze_heap = False

    @classmethod
    def from_model(cls, model: str, *, engine_process: bool = True, **engine_args: Any) -> "AsyncLLM":
        return cls(EngineConfig.from_kwargs(model, **engine_args), engine_process=engine_process)

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the output loop now (``generate`` also starts it on first use)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        await self._started

    async def _start(self) -> None:
        freeze_heap()  # full collections of the serving loop skip the start-up objects
        self._froze_heap = True
        await self.core.start()
        self._tasks.append(asyncio.create_task(self._output_loop(), name="pagelm-output-loop"))
        if self.log_stats_interval:
            self._tasks.append(asyncio.create_task(self._log_loop(), name="pagelm-stats-log"))

    @property
    def is_running(self) -> bool:
        return self.dead_error is None

    def shutdown(self) -> None:
        """Stop the output loop and the engine core (idempotent)."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        self.core.shutdown()
        if self._froze_heap:
            self._froze_heap = False
            thaw_heap()

    # ---- requests -------------------------------------------------------------------------
    async def generate(
        self,
        prompt: PromptType | ProcessedRequest,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        output_kind: OutputKind = OutputKind.DELTA,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs: deltas (``OutputKind.DELTA``, the default) or one final
        output (``FINAL_ONLY``). Bad input raises ``ValueError`` before anything is queued; a
        ``ProcessedRequest`` (already checked, e.g. by the server) is not checked again.
        Leaving the loop early (or being cancelled) aborts the request."""
        await self.start()
        if self.dead_error is not None:
            raise self.dead_error
        if self.draining:
            raise EngineShuttingDown("the server is shutting down and takes no new requests")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(prompt, ProcessedRequest):  # checked here, once
            prompt = self.engine.inputs.process(prompt, sampling_params, priority)
        self.engine.add_processed(request_id, prompt, output_kind=output_kind, cache_salt=cache_salt)
        stream = self._streams[request_id] = _Stream()
        finished = False
        try:
            while not finished:
                try:
                    out = await stream.get()
                except _Aborted:
                    return
                finished = out.finished
                if out.error is not None:  # its grammar did not compile (bad input), or a step failed
                    raise EngineStepError(out.error) if out.error.startswith(ENGINE_FAULT) else ValueError(out.error)
                yield out
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished and self.dead_error is None:
                self._abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request (the id of an ``n > 1`` request aborts all its samples); its KV
        blocks are freed before the engine's next step."""
        stream = self._streams.pop(request_id, None)
        self._abort(request_id)
        if stream is not None:
            stream.fail(_Aborted())

    def _abort(self, request_id: str) -> None:
        live = self.engine.abort_request([request_id])
        if live:  # else it has finished already
            # Each sample is a request, as in vLLM.
            self._to_stat_loggers("request_finished", lambda s: s.request_finished("abort", len(live)))

    # ---- the output side ------------------------------------------------------------------
    async def _output_loop(self) -> None:
        processor = self.engine.output_processor
        try:
            while True:
                step = await self.core.get_output()
                iteration = IterationStats()
                results, stopped = processor.process_outputs(step.outputs, iteration)
                if stopped:
                    self.core.finish_by_stop_string(stopped)
                streams = self._streams
                for out in results:
                    stream = streams.get(out.request_id)
                    if stream is not None:
                        stream.put(out)
                self.stats = step.stats
                self._to_stat_loggers("record", lambda s: s.record(step.stats, iteration))
        except asyncio.CancelledError:
            raise
        except EngineDeadError as exc:
            self._fail(exc)
            if self.num_engine_restarts < self.max_engine_restarts:
                self._tasks.append(asyncio.create_task(self._restart(), name="pagelm-engine-restart"))
        except Exception as exc:
            logger.exception("the output loop failed")
            self._fail(EngineDeadError(f"the output loop failed: {exc}"))

    async def _restart(self) -> None:
        """A fresh engine core in place of the dead one (else the API process would answer
        500/503 forever). Until it is up, requests fail fast with ``EngineDeadError``."""
        self.num_engine_restarts += 1
        logger.warning("restarting the engine core (%d of at most %d)", self.num_engine_restarts, self.max_engine_restarts)
        self.dead_error = EngineDeadError(f"the engine core is restarting after: {self.dead_error}")
        try:
            await asyncio.to_thread(self.engine.restart_core)  # loads the model: seconds
            self.core = self.engine.core
            await self.core.start()
        except Exception as exc:
            logger.exception("the engine core could not be restarted")
            self.dead_error = EngineDeadError(f"the engine core could not be restarted: {exc}")
            return
        self.stats = SchedulerStats(num_free_blocks=self.core.num_kv_blocks, num_kv_blocks=self.core.num_kv_blocks)
        self._to_stat_loggers("engine_restarted", lambda s: s.engine_restarted(self.stats))
        self.dead_error = None
        self._tasks.append(asyncio.create_task(self._output_loop(), name="pagelm-output-loop"))
        logger.warning("the engine core is back")

    def begin_drain(self) -> None:
        """Refuse new requests; those running go on until they finish or ``end_streams``."""
        self.draining = True

    def end_streams(self, error: EngineDeadError) -> None:
        """End every running request with ``error`` (the drain time is up), as its stream's
        last item, so that servers can close it properly."""
        if self._streams:
            logger.warning("ending %d running requests: %s", len(self._streams), error)
        for request_id, stream in list(self._streams.items()):
            self._abort(request_id)
            stream.fail(error)
        self._streams.clear()

    def _fail(self, error: EngineDeadError) -> None:
        logger.error("engine is dead: %s", error)
        self.dead_error = error
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()

    async def _log_loop(self) -> None:
        while True:
            await asyncio.sleep(self.log_stats_interval)
            self._to_stat_loggers("log", lambda s: s.log())

    def _to_stat_loggers(self, what: str, call) -> None:
        """``call(stat_logger)`` for each; one that raises is logged and dropped (a plugin's
        bug must not stop the engine serving)."""
        for name, stat_logger in list(self.stat_loggers.items()):
            try:
                call(stat_logger)
            except Exception:
                logger.exception("stat logger %r raised in %s and is dropped; the engine carries on", name, what)
                del self.stat_loggers[name]
