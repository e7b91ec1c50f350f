"""The engine core's busy loop, shared by the thread and the process that can host it.

Each turn: take every command that has arrived (add, abort, stop), run one ``EngineCore.step()``
and publish its outputs with a ``SchedulerStats`` snapshot. With no request left it blocks on
the next command, so an idle engine costs nothing::

    while True:
        commands = inbox(block=not core.has_unfinished_requests())
        apply(commands)           # add_request / abort_requests / finish_by_stop_string
        publish(core.step(), stats(core))
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagelm.engine.core_output import ENGINE_FAULT, EngineCoreOutput
from pagelm.engine.engine_core import EngineCore
from pagelm.executor import RankDiedError
from pagelm.kv_offload import KVOffloadStats
from pagelm.multimodal import MultiModalFeature
from pagelm.request import Request
from pagelm.sampling_params import SamplingParams
from pagelm.worker.output import LogprobsLists

# Commands, as (kind, payload) tuples. REJECT: (request id, why) for an ADD whose payload
# could not even be decoded into a Request.
ADD, ABORT, STOP, SHUTDOWN, REJECT = "add", "abort", "stop", "shutdown", "reject"

logger = logging.getLogger("pagelm")

# Steps in a row that may raise before the loop gives up (see run_core_loop).
MAX_CONSECUTIVE_STEP_FAILURES = 3


@dataclass
class SchedulerStats:
    """The engine core's state after one step; counters are totals since start."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_kv_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # Speculative decoding totals (see pagelm.spec_decode.stats).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # Exceptions plugins' lifecycle hooks raised (caught; see PluginManager.notify).
    num_plugin_errors: int = 0
    # The second KV tier (pagelm.kv_offload; all 0 without one): its state and totals.
    kv_offload: KVOffloadStats = field(default_factory=KVOffloadStats)
    # Vision-language models: images looked up in the encoder cache, found there, and the
    # share of the cache that running requests hold (totals; 0 for text-only models).
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0
    encoder_cache_usage: float = 0.0

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0

    @classmethod
    def of(cls, core: EngineCore) -> "SchedulerStats":
        kv = core.kv_cache_manager
        spec = core.scheduler.spec_decoding_stats
        encoder = core.scheduler.encoder_cache
        return cls(
            core.scheduler.num_running,
            core.scheduler.num_waiting,
            kv.num_free_blocks,
            core.num_kv_blocks,
            kv.prefix_cache_stats.queries,
            kv.prefix_cache_stats.hits,
            core.scheduler.num_preemptions,
            spec.num_drafts,
            spec.num_draft_tokens,
            spec.num_accepted_tokens,
            list(spec.num_accepted_tokens_per_pos),
            core.plugins.num_hook_errors,
            kv.offload.stats() if kv.offload is not None else KVOffloadStats(),
            encoder.stats.queries if encoder else 0,
            encoder.stats.hits if encoder else 0,
            encoder.usage() if encoder else 0.0,
        )


def core_facts(core: EngineCore) -> dict[str, int]:
    """What a client learns of the engine core it started (``CoreClient.set_facts``)."""
    return {"max_model_len": core.max_model_len, "vocab_size": core.vocab_size,
            "num_kv_blocks": core.num_kv_blocks, "block_size": core.config.block_size}


_num_frozen_heaps = 0  # engines in this process that froze the heap and have not thawed it


def freeze_heap() -> None:
    """Move everything allocated so far (modules, weights' Python objects) out of the garbage
    collector's reach: start-up objects never die, and otherwise each full collection walks
    them all, stalling the loop. An engine that shuts down while its process lives on (an
    in-process ``AsyncLLM``) calls ``thaw_heap``."""
    global _num_frozen_heaps
    gc.collect()
    gc.freeze()
    _num_frozen_heaps += 1


def thaw_heap() -> None:
    """Undo one ``freeze_heap``. The last engine to thaw hands every frozen object back to the
    collector, so a shut-down engine's cycles (and the GPU memory they hold) can be freed;
    while another engine still serves, its start-up objects stay frozen."""
    global _num_frozen_heaps
    _num_frozen_heaps = max(_num_frozen_heaps - 1, 0)
    if _num_frozen_heaps == 0:
        gc.unfreeze()


def run_core_loop(
    core: EngineCore,
    inbox: Callable[[bool], list[tuple[str, Any]]],
    publish: Callable[[list[EngineCoreOutput], SchedulerStats], None],
) -> None:
    """Serve commands until SHUTDOWN. ``inbox(block)`` returns the commands that have arrived
    (waiting for at least one when ``block``)."""
    failures = 0
    while True:
        commands = inbox(not core.has_unfinished_requests())
        rejected: list[EngineCoreOutput] = []
        for kind, payload in commands:
            if kind == ADD:
                error = _try_add(core, payload)
                if error is not None:
                    rejected.append(error)
            elif kind == REJECT:
                rejected.append(_error_output(*payload))
            elif kind == ABORT:
                core.abort_requests(payload)
            elif kind == STOP:
                core.finish_by_stop_string(payload)
            elif kind == SHUTDOWN:
                return
            else:
                raise ValueError(f"unknown engine core command {kind!r}")
        # Also runs after an abort left nothing to do: the runner drops the request's state
        # and the published stats show its blocks free again.
        try:
            outputs = core.step()
            failures = 0
        except Exception as exc:
            # One bad step fails the requests in the engine, not the engine: the next ones
            # are served. Several in a row, or a rank that died, mean the engine itself is
            # broken (a dead device):
            # then the loop stops and its host reports the engine dead (and may restart it).
            failures += 1
            if failures >= MAX_CONSECUTIVE_STEP_FAILURES or isinstance(exc, RankDiedError):
                raise
            logger.exception("an engine step failed; failing the %d requests in the engine", len(core.scheduler.requests))
            outputs = core.fail_all(f"{ENGINE_FAULT}: {type(exc).__name__}: {exc}")
        publish(rejected + outputs, SchedulerStats.of(core))


def _try_add(core: EngineCore, request: Request) -> EngineCoreOutput | None:
    """Add one request; a request the engine core cannot take fails alone (its error goes
    out with the step's outputs) instead of stopping the loop that serves everyone."""
    try:
        core.add_request(request)
    except Exception as exc:
        logger.warning("engine core rejected request %s: %s: %s", request.request_id, type(exc).__name__, exc)
        return _error_output(request.request_id, f"{type(exc).__name__}: {exc}")
    return None


def _error_output(request_id: str, error: str) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, [], finish_reason="error", error=error)


# ---- wire format (msgpack-able plain data) ------------------------------------------------
# Field order is the contract between the two processes; both sides use these functions.


def encode_request(req: Request) -> list:
    return [
        req.request_id, req.prompt_token_ids, req.sampling_params.to_wire(), list(req.eos_token_ids),
        req.arrival_time, req.priority, req.cache_salt, req.max_tokens, [f.to_wire() for f in req.mm_features],
    ]


def decode_request(data: list) -> Request:
    req_id, prompt_ids, params, eos, arrival, priority, salt, max_tokens, mm_features = data
    return Request(
        req_id, prompt_ids, SamplingParams(**params), eos_token_ids=frozenset(eos),
        arrival_time=arrival, priority=priority, cache_salt=salt, max_tokens=max_tokens,
        mm_features=[MultiModalFeature.from_wire(f) for f in mm_features],
    )


def _encode_lp(lp: LogprobsLists | None) -> list | None:
    return None if lp is None else [lp.token_ids, lp.logprobs, lp.ranks]


def _decode_lp(data: list | None) -> LogprobsLists | None:
    return None if data is None else LogprobsLists(*data)


def encode_outputs(outputs: list[EngineCoreOutput]) -> list:
    """Each output as a list in ``EngineCoreOutput``'s field order."""
    return [
        [
            o.request_id, o.new_token_ids, _encode_lp(o.new_logprobs), _encode_lp(o.new_prompt_logprobs),
            o.finish_reason, o.stop_reason, o.num_cached_tokens, o.first_scheduled_time, o.error,
            o.num_draft_tokens, o.num_accepted_tokens,
        ]
        for o in outputs
    ]


def decode_outputs(data: list) -> list[EngineCoreOutput]:
    return [EngineCoreOutput(rid, ids, _decode_lp(lp), _decode_lp(plp), *rest) for rid, ids, lp, plp, *rest in data]


def encode_stats(stats: SchedulerStats) -> list:
    return list(dataclasses.astuple(stats))


def decode_stats(data: list) -> SchedulerStats:
    stats = SchedulerStats(*data)
    stats.kv_offload = KVOffloadStats(*stats.kv_offload)
    return stats
