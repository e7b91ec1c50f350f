"""Prometheus metrics for the async engine, with vLLM's names under ``pagelm:``, and the
periodic one-line stats log.

Gauges and counters are updated once per engine step from ``SchedulerStats`` (totals kept by
the engine core); histograms once per finished request, from its ``RequestMetrics``.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagelm.engine.core_loop import SchedulerStats
from pagelm.engine.core_output import EngineCoreOutput
from pagelm.outputs import RequestOutput

logger = logging.getLogger("pagelm")

_LATENCY_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0,
]
_ITL_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]


class EngineMetrics:
    """One registry per engine, so several engines (tests) can live in one process."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pagelm:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pagelm:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(f"pagelm:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).")
        self.num_free_kv_blocks = gauge("num_free_kv_blocks", "Free KV cache blocks.")
        self.num_kv_blocks = gauge("num_kv_blocks", "KV cache blocks in total.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (recomputed) by the scheduler.")
        self.plugin_errors = counter("plugin_errors", "Exceptions raised by plugins' lifecycle hooks (caught and logged).")
        self.engine_restarts = counter("engine_restarts", "Engine cores started in place of a dead one.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        # Speculative decoding, vLLM's names: mean acceptance length = 1 + accepted / drafts.
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Speculative verification rounds.")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted by the target."
        )
        self._spec_accepted_per_pos = Counter(
            "pagelm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft.",
            ["model_name", "position"], registry=r,
        )
        self._request_success = Counter(
            "pagelm:request_success", "Requests finished, by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"], registry=r,
        )
        self._model_name = model_name
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first output token.", _LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Mean gap between a request's output tokens (one observation per finished request).",
            _ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to last output token.", _LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS
        )
        self._last = SchedulerStats()
        # Plain totals for the stats log (prometheus values are not meant to be read back).
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0

    def engine_restarted(self, stats: SchedulerStats) -> None:
        """A fresh engine core: its counters start from zero again."""
        self.engine_restarts.inc()
        self._last = stats
        self.record_step(stats, [], [])

    def request_finished(self, reason: str) -> None:
        self._request_success.labels(self._model_name, reason).inc()

    def record_step(
        self, stats: SchedulerStats, outputs: list[EngineCoreOutput], results: list[RequestOutput]
    ) -> int:
        """Fold one engine step in; returns the number of tokens it generated."""
        last, self._last = self._last, stats
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.num_free_kv_blocks.set(stats.num_free_blocks)
        self.num_kv_blocks.set(stats.num_kv_blocks)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries - last.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits - last.prefix_cache_hits)
        self.num_preemptions.inc(stats.num_preemptions - last.num_preemptions)
        self.plugin_errors.inc(stats.num_plugin_errors - last.num_plugin_errors)
        if stats.spec_num_drafts != last.spec_num_drafts:
            self._record_spec_decode(stats, last)
        generated = sum(len(o.new_token_ids) for o in outputs)
        self.generation_tokens.inc(generated)
        self.total_generation_tokens += generated
        for out in results:
            if out.finished:
                self._request_done(out)
        return generated

    def _record_spec_decode(self, stats: SchedulerStats, last: SchedulerStats) -> None:
        self.spec_decode_num_drafts.inc(stats.spec_num_drafts - last.spec_num_drafts)
        self.spec_decode_num_draft_tokens.inc(stats.spec_num_draft_tokens - last.spec_num_draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(stats.spec_num_accepted_tokens - last.spec_num_accepted_tokens)
        before = last.spec_num_accepted_tokens_per_pos
        for pos, total in enumerate(stats.spec_num_accepted_tokens_per_pos):
            delta = total - (before[pos] if pos < len(before) else 0)
            if delta:
                self._spec_accepted_per_pos.labels(self._model_name, str(pos)).inc(delta)

    def _request_done(self, out: RequestOutput) -> None:
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.total_prompt_tokens += len(out.prompt_token_ids)
        self.request_finished(out.outputs[-1].finish_reason or "abort")
        m = out.metrics
        if m is None or m.first_token_time is None:
            return
        self.time_to_first_token.observe(m.first_token_time - m.arrival_time)
        if m.finished_time is not None:
            self.e2e_request_latency.observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.request_queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.num_generation_tokens > 1 and m.last_token_time is not None:
            self.inter_token_latency.observe(
                (m.last_token_time - m.first_token_time) / (m.num_generation_tokens - 1)
            )


class StatsLogger:
    """Logs throughput, running/waiting and KV usage; called every ``interval`` seconds."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        self._time = time.monotonic()
        self._prompt = self._generation = 0
        self._spec = (0, 0, 0)  # drafts, draft tokens, accepted tokens at the last log

    def log(self, stats: SchedulerStats) -> None:
        now = time.monotonic()
        prompt, generation = self.metrics.total_prompt_tokens, self.metrics.total_generation_tokens
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
        logger.info(
            "prompt throughput: %.1f tok/s, generation throughput: %.1f tok/s, running: %d reqs, "
            "waiting: %d reqs, KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%%s",
            d_prompt / elapsed, d_gen / elapsed, stats.num_running, stats.num_waiting,
            100 * stats.kv_cache_usage, 100 * hit_rate, spec_line,
        )
