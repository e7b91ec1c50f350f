"""The ``logging`` stat logger: every ``log_stats_interval`` seconds one line with the
prompt and generation throughput, running/waiting requests, KV cache usage, prefix cache hit
rate, speculative decoding's acceptance and the CPU tier's usage; quiet while the engine is idle."""

from __future__ import annotations

import logging
import time

from pagelm.config import EngineConfig
from pagelm.engine.core_loop import SchedulerStats
from pagelm.engine.iteration_stats import IterationStats
from pagelm.stat_logger import StatLogger

logger = logging.getLogger("pagelm")


class LoggingStatLogger(StatLogger):
    name = "logging"

    def __init__(self, config: EngineConfig, model_name: str, max_model_len: int, stats: SchedulerStats) -> None:
        super().__init__(config, model_name, max_model_len, stats)
        self.stats = stats
        self.total_prompt_tokens = self.total_generation_tokens = 0
        self._time = time.monotonic()
        self._prompt = self._generation = 0
        self._spec = (0, 0, 0)  # drafts, draft tokens, accepted tokens at the last log

    def record(self, stats: SchedulerStats, iteration: IterationStats | None = None) -> None:
        self.stats = stats
        if iteration is not None:
            self.total_prompt_tokens += iteration.num_prompt_tokens
            self.total_generation_tokens += iteration.num_generation_tokens

    def engine_restarted(self, stats: SchedulerStats) -> None:
        self.stats = stats
        self._spec = (0, 0, 0)  # the fresh core's totals start from zero

    def log(self) -> None:
        now, stats = time.monotonic(), self.stats
        prompt, generation = self.total_prompt_tokens, self.total_generation_tokens
        elapsed = max(now - self._time, 1e-9)
        d_prompt, d_gen = prompt - self._prompt, generation - self._generation
        self._time, self._prompt, self._generation = now, prompt, generation
        if not (d_prompt or d_gen or stats.num_running or stats.num_waiting):
            return  # idle: stay quiet
        hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        spec = (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)
        drafts, drafted, accepted = (now_ - then for now_, then in zip(spec, self._spec))
        self._spec = spec
        spec_line = ""
        if drafts:
            spec_line = (
                f", spec decode: mean acceptance length {1 + accepted / drafts:.2f}, "
                f"acceptance rate {100 * accepted / drafted:.1f}%"
            )
        tier = stats.kv_offload
        if tier.num_blocks:
            spec_line += f", CPU KV cache usage: {100 * tier.usage:.1f}%, swapped: {tier.num_swapped_requests} reqs"
        if stats.encoder_cache_queries:  # a vision-language model
            spec_line += f", encoder cache hit rate: {100 * stats.encoder_cache_hits / stats.encoder_cache_queries:.1f}%"
        logger.info(
            "prompt throughput: %.1f tok/s, generation throughput: %.1f tok/s, running: %d reqs, "
            "waiting: %d reqs, KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%%s",
            d_prompt / elapsed, d_gen / elapsed, stats.num_running, stats.num_waiting,
            100 * stats.kv_cache_usage, 100 * hit_rate, spec_line,
        )
