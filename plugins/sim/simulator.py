"""Replay a trace through the real ``Scheduler`` and ``KVCacheManager`` in simulated time.

Each step: add the requests that have arrived, ``schedule()``, advance the clock by the cost
model's step time, and feed ``update_from_output`` what a model would have sampled (EOS at
the trace's ``output_len``). Only the model is simulated; admission, chunking, prefix
caching, preemption and the policy plugin are the engine's own code.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagelm.config import EngineConfig
from pagelm.kv_cache import KVCacheManager, cdiv, make_block_hasher
from pagelm.plugin_manager import get_plugin_manager
from pagelm.registry import raise_problems
from pagelm.request import Request
from pagelm.sampling_params import SamplingParams
from pagelm.sched.scheduler import Scheduler
from pagelm.plugins.sim.cost_model import EOS_TOKEN_ID, CostModel, simulated_runner_output
from pagelm.plugins.sim.trace import TraceRequest


@dataclass
class SimConfig:
    """The engine knobs that matter to scheduling (``EngineConfig`` names)."""

    block_size: int = 16
    num_kv_blocks: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    enable_prefix_caching: bool = True
    plugin_config: dict[str, Any] = field(default_factory=dict)

    def engine_config(self, policy: str) -> EngineConfig:
        return EngineConfig(
            model="(simulated)",
            scheduling_policy=policy,
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_num_partial_prefills=self.max_num_partial_prefills,
            enable_prefix_caching=self.enable_prefix_caching,
            plugin_config=self.plugin_config,
        )


@dataclass
class Timeline:
    """One sample per step."""

    time: list[float] = field(default_factory=list)
    num_waiting: list[int] = field(default_factory=list)
    num_running: list[int] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)


@dataclass
class SimResult:
    policy: str
    arrival: np.ndarray  # per trace request, seconds
    first_token: np.ndarray
    finish: np.ndarray
    priority: np.ndarray
    output_tokens: int
    num_preemptions: int
    prefix_cache_hit_rate: float
    num_steps: int
    wall_seconds: float
    timeline: Timeline

    @property
    def ttft(self) -> np.ndarray:
        return self.first_token - self.arrival

    @property
    def e2e(self) -> np.ndarray:
        return self.finish - self.arrival

    @property
    def makespan(self) -> float:
        return float(self.finish.max() - self.arrival.min())

    def summary(self) -> dict[str, float]:
        ttft, e2e = self.ttft, self.e2e
        return {
            "requests": len(e2e),
            "ttft_p50": float(np.percentile(ttft, 50)),
            "ttft_p99": float(np.percentile(ttft, 99)),
            "e2e_mean": float(e2e.mean()),
            "e2e_p50": float(np.percentile(e2e, 50)),
            "e2e_p99": float(np.percentile(e2e, 99)),
            "output_tok_per_s": self.output_tokens / self.makespan,
            "req_per_s": len(e2e) / self.makespan,
            "preemptions": self.num_preemptions,
            "prefix_hit_rate": self.prefix_cache_hit_rate,
            "steps": self.num_steps,
            "simulated_s": self.makespan,
            "wall_s": self.wall_seconds,
        }

    def ttft_p99_by_priority(self) -> dict[int, float]:
        return {
            int(p): float(np.percentile(self.ttft[self.priority == p], 99)) for p in np.unique(self.priority)
        }


def _prompt_tokens(index: int, req: TraceRequest) -> list[int]:
    """Token ids: a shared prefix derived from ``prefix_id`` (equal ids give equal tokens, so
    the prefix cache hits), then a tail unique to the request. Ids never reach a model."""
    shared = 0
    tokens: list[int] = []
    if req.prefix_id is not None:
        shared = req.prompt_len if req.prefix_len is None else req.prefix_len
        base = (zlib.crc32(str(req.prefix_id).encode()) + 1) << 20
        tokens = list(range(base, base + shared))
    # Negative ids cannot collide with the prefix ids or the sampled EOS/filler ids.
    tokens += [-(index + 1)] * (req.prompt_len - shared)
    return tokens


def simulate(
    trace: list[TraceRequest],
    policy: str,
    config: SimConfig | None = None,
    cost: CostModel | None = None,
) -> SimResult:
    config = config or SimConfig()
    cost = cost or CostModel()
    engine_config = config.engine_config(policy)
    policy_cls = get_plugin_manager().collect("scheduling policy").get(policy)
    raise_problems(f"scheduling_policy={policy!r}", policy_cls.validate(engine_config))
    max_model_len = max(r.prompt_len + (r.max_tokens or r.output_len) for r in trace)
    if cdiv(max_model_len, config.block_size) > config.num_kv_blocks:
        raise ValueError(
            f"the longest trace request needs {max_model_len} tokens of KV, more than the "
            f"{config.num_kv_blocks} x {config.block_size} pool holds"
        )
    kv = KVCacheManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
    sched = Scheduler(engine_config, kv, policy_cls(engine_config), max_model_len + 1)
    hasher = make_block_hasher(config.block_size) if config.enable_prefix_caching else None

    n = len(trace)
    arrival = np.array([r.arrival_time for r in trace])
    first_token = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    output_lens = {str(i): r.output_len for i, r in enumerate(trace)}
    timeline = Timeline()
    eos = frozenset({EOS_TOKEN_ID})
    now, next_arrival, num_steps, output_tokens = 0.0, 0, 0, 0
    started = time.perf_counter()

    while next_arrival < n or sched.has_unfinished_requests():
        while next_arrival < n and trace[next_arrival].arrival_time <= now:
            req = trace[next_arrival]
            sched.add_request(
                Request(
                    str(next_arrival),
                    _prompt_tokens(next_arrival, req),
                    SamplingParams(max_tokens=req.max_tokens or req.output_len),
                    eos_token_ids=eos,
                    arrival_time=req.arrival_time,
                    priority=req.priority,
                    block_hasher=hasher,
                )
            )
            next_arrival += 1
        if not sched.has_unfinished_requests():
            now = trace[next_arrival].arrival_time  # idle until the next arrival
            continue
        out = sched.schedule()
        if out.is_empty:
            # Only right after a preemption freed everything; the next step admits again.
            assert out.preempted_req_ids, "the scheduler made no progress with requests waiting"
            continue
        now += cost.step_seconds(out, sched.requests)
        runner_out = simulated_runner_output(out, sched.requests, output_lens)
        outputs, finished = sched.update_from_output(out, runner_out)
        num_steps += 1
        for o in outputs:
            if o.new_token_ids:
                output_tokens += len(o.new_token_ids)
                i = int(o.request_id)
                if np.isnan(first_token[i]):
                    first_token[i] = now
        for req in finished:
            finish[int(req.request_id)] = now
        timeline.time.append(now)
        timeline.num_waiting.append(sched.num_waiting)
        timeline.num_running.append(sched.num_running)
        timeline.kv_usage.append(kv.usage())

    assert kv.num_free_blocks == kv.num_blocks, "KV blocks leaked in the simulation"
    return SimResult(
        policy=policy,
        arrival=arrival,
        first_token=first_token,
        finish=finish,
        priority=np.array([r.priority for r in trace]),
        output_tokens=output_tokens,
        num_preemptions=sched.num_preemptions,
        prefix_cache_hit_rate=kv.prefix_cache_stats.hit_rate,
        num_steps=num_steps,
        wall_seconds=time.perf_counter() - started,
        timeline=timeline,
    )
