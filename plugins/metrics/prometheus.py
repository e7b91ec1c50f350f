"""The ``prometheus`` stat logger: the async engine's metrics under vLLM's names, types,
labels and buckets (``vllm:*``, labels ``model_name`` and ``engine``), so that dashboards,
alerts and autoscalers written for vLLM work unchanged; metrics only pagelm has stay
``pagelm:*``. Plus the process and Python GC collectors. ``pagelm serve`` answers
``/metrics`` from its ``registry``.

Gauges and counters are updated once per engine step from ``SchedulerStats`` (totals the
engine core keeps) and the step's ``IterationStats`` (what its outputs did, gathered by the
output processor in the API process); request histograms once per finished request.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, Histogram, PlatformCollector
from prometheus_client import ProcessCollector
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pagelm.config import EngineConfig
from pagelm.engine.core_loop import SchedulerStats
from pagelm.engine.iteration_stats import FinishedRequestStats, IterationStats
from pagelm.kv_offload import KVOffloadStats
from pagelm.stat_logger import StatLogger

# vLLM V1's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]
TOKEN_LATENCY_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]
REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
N_BUCKETS = [1, 2, 5, 10, 20]
FINISH_REASONS = ("stop", "length", "abort", "error")
LABELS = ["model_name", "engine"]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


def cache_config_info(config: EngineConfig, num_gpu_blocks: int) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info``: vLLM's CacheConfig field names, for the
    fields pagelm has (the KV cache is in the model's dtype: vLLM's ``auto``)."""
    return {
        "block_size": str(config.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "gpu_memory_utilization": str(config.gpu_memory_utilization),
        "num_gpu_blocks": str(num_gpu_blocks),
        "num_gpu_blocks_override": str(config.num_kv_blocks),
        "prefix_caching_hash_algo": "sha256",
    }


class TokenLatencyHistogram(Collector):
    """A histogram observed once per output token: bucket counts kept in a list and found by
    ``bisect`` (about 0.1 us a value, where ``Histogram.observe`` takes its lock and walks the
    buckets in 1.5 us). Exposed under each of ``names``, which share the observations. Only
    the API process's event loop observes it."""

    def __init__(self, names: dict[str, str], buckets: list[float], label_values: list[str]) -> None:
        self.names, self.bounds, self.label_values = names, buckets, label_values
        self.counts = [0] * (len(buckets) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe_many(self, values: Iterable[float]) -> None:
        bounds, counts, total = self.bounds, self.counts, 0.0
        for v in values:
            counts[bisect_left(bounds, v)] += 1  # the first bound >= v: Prometheus' le
            total += v
        self.sum += total

    def describe(self) -> Iterator[Metric]:
        for name, doc in self.names.items():
            yield HistogramMetricFamily(name, doc, labels=LABELS)

    def collect(self) -> Iterator[Metric]:
        cumulative, running = [], 0
        for bound, count in zip([*self.bounds, float("inf")], self.counts):
            running += count
            cumulative.append((floatToGoString(bound), running))
        for name, doc in self.names.items():
            family = HistogramMetricFamily(name, doc, labels=LABELS)
            family.add_metric(self.label_values, cumulative, self.sum)
            yield family


class PrometheusStatLogger(StatLogger):
    """One registry per engine, so several engines (tests) can live in one process."""

    name = "prometheus"

    def __init__(self, config: EngineConfig, model_name: str, max_model_len: int, stats: SchedulerStats) -> None:
        super().__init__(config, model_name, max_model_len, stats)
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.label_values = [model_name, "0"]  # one engine core: engine "0"
        self._define_state_metrics(cache_config_info(config, stats.num_kv_blocks))
        self._define_token_metrics(build_1_2_5_buckets(max_model_len))
        self._define_latency_metrics()
        self._last = SchedulerStats()
        self.record(stats)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, LABELS, registry=self.registry).labels(*self.label_values)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, LABELS, registry=self.registry).labels(*self.label_values)

    def _histogram(self, name: str, doc: str, buckets: list[float]) -> Histogram:
        return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry).labels(*self.label_values)

    def _define_state_metrics(self, cache_info: dict[str, str]) -> None:
        """The scheduler and KV cache after each step, and pagelm's own engine metrics."""
        gauge, counter = self._gauge, self._counter
        self.num_requests_running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        # vLLM's name before 0.9, still what its example Grafana dashboard plots.
        self.gpu_cache_usage_perc = gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
        )
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self._cache_config_info = Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", [*cache_info, "engine"],
            registry=self.registry,
        )
        self.set_cache_config_info(cache_info)
        # Vision-language models: the encoder cache (images, not embeddings; 0 for text models).
        self.encoder_cache_queries = counter(
            "pagelm:encoder_cache_queries", "Images looked up in the encoder cache when a request first needed them."
        )
        self.encoder_cache_hits = counter(
            "pagelm:encoder_cache_hits", "Of those, images whose embeddings were cached (the encoder did not run)."
        )
        self.encoder_cache_usage_perc = gauge(
            "pagelm:encoder_cache_usage_perc", "Encoder-cache usage by running requests. 1 means 100 percent usage."
        )
        # Speculative decoding: mean acceptance length = 1 + accepted / drafts.
        self.spec_decode_num_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_decode_num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_decode_num_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        self._spec_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
            [*LABELS, "position"], registry=self.registry,
        )
        self.num_free_kv_blocks = gauge("pagelm:num_free_kv_blocks", "Free KV cache blocks.")
        self.num_kv_blocks = gauge("pagelm:num_kv_blocks", "KV cache blocks in total.")
        self.plugin_errors = counter(
            "pagelm:plugin_errors", "Exceptions raised by plugins' lifecycle hooks (caught and logged)."
        )
        self.engine_restarts = counter("pagelm:engine_restarts", "Engine cores started in place of a dead one.")
        self._define_kv_offload_metrics()

    def _define_kv_offload_metrics(self) -> None:
        """The CPU tier of the KV cache (swap_space; all zero without one): vLLM 0's names
        for its usage and swapped requests, pagelm's for the copies and tier hits."""
        gauge, counter = self._gauge, self._counter
        self.cpu_cache_usage_perc = gauge("vllm:cpu_cache_usage_perc", "CPU KV-cache usage. 1 means 100 percent usage.")
        self.num_requests_swapped = gauge("vllm:num_requests_swapped", "Number of requests swapped to CPU.")
        self.num_cpu_blocks = gauge("pagelm:num_cpu_blocks", "KV cache blocks in the CPU tier in total.")
        self.num_free_cpu_blocks = gauge("pagelm:num_free_cpu_blocks", "Free KV cache blocks in the CPU tier.")
        self.kv_blocks_swapped_out = counter(
            "pagelm:kv_blocks_swapped_out", "KV blocks copied GPU -> CPU tier (swap preemption and prefix spill)."
        )
        self.kv_blocks_swapped_in = counter(
            "pagelm:kv_blocks_swapped_in", "KV blocks copied CPU tier -> GPU (swapped-in requests and prefix hits)."
        )
        self.kv_bytes_swapped_out = counter("pagelm:kv_bytes_swapped_out", "Bytes of KV copied GPU -> CPU tier.")
        self.kv_bytes_swapped_in = counter("pagelm:kv_bytes_swapped_in", "Bytes of KV copied CPU tier -> GPU.")
        self.num_swap_preemptions = counter(
            "pagelm:num_swap_preemptions", "Preemptions that swapped the victim to the CPU tier (of vllm:num_preemptions)."
        )
        self.cpu_prefix_cache_hits = counter(
            "pagelm:cpu_prefix_cache_hits", "Prefix cache hits served from the CPU tier, in tokens (of vllm:prefix_cache_hits)."
        )

    def _define_token_metrics(self, token_buckets: list[int]) -> None:
        """Token counts, per step and per request, and requests by how they finished."""
        counter, histogram = self._counter, self._histogram
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._request_success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", [*LABELS, "finished_reason"],
            registry=self.registry,
        )
        for reason in FINISH_REASONS:  # every reason from the start, so that increase() sees the first one
            self._request_success.labels(*self.label_values, reason)
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.request_prefill_kv_computed_tokens = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).", token_buckets,
        )
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", token_buckets,
        )
        self.request_params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )

    def _define_latency_metrics(self) -> None:
        """Time to first token, between tokens, and each phase of a request."""
        histogram = self._histogram
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.inter_token_latency = TokenLatencyHistogram({
            "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
            # vLLM's name for the same observations until 0.11 (and in its example dashboard).
            "vllm:time_per_output_token_seconds": "Histogram of time per output token in seconds."
                                                  "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
        }, TOKEN_LATENCY_BUCKETS, self.label_values)
        self.registry.register(self.inter_token_latency)
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", TOKEN_LATENCY_BUCKETS,
        )

        def phase(name: str, doc: str) -> Histogram:
            return histogram(f"vllm:{name}", doc, REQUEST_LATENCY_BUCKETS)

        self.e2e_request_latency = phase("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.")
        self.request_queue_time = phase(
            "request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."
        )
        self.request_inference_time = phase(
            "request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request."
        )
        self.request_prefill_time = phase(
            "request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."
        )
        self.request_decode_time = phase(
            "request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."
        )

    def set_cache_config_info(self, info: dict[str, str]) -> None:
        """(Re)state the cache configuration: a fresh engine core may have another block count."""
        self._cache_config_info.clear()
        self._cache_config_info.labels(**info, engine=self.label_values[1]).set(1)

    def engine_restarted(self, stats: SchedulerStats) -> None:
        """A fresh engine core: its counters start from zero again, its block count may differ."""
        self.set_cache_config_info(cache_config_info(self.config, stats.num_kv_blocks))
        self.engine_restarts.inc()
        self._last = stats
        self.record(stats)

    def request_finished(self, reason: str, count: int = 1) -> None:
        """``count`` requests ended with ``reason``; those aborted by their client end outside
        the output processor and come here directly."""
        self._request_success.labels(*self.label_values, reason).inc(count)

    def record(self, stats: SchedulerStats, step: IterationStats | None = None) -> None:
        """Fold one engine step in: the engine core's state after it, and what its outputs did."""
        last, self._last = self._last, stats
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.gpu_cache_usage_perc.set(stats.kv_cache_usage)
        self.num_free_kv_blocks.set(stats.num_free_blocks)
        self.num_kv_blocks.set(stats.num_kv_blocks)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries - last.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits - last.prefix_cache_hits)
        self.num_preemptions.inc(stats.num_preemptions - last.num_preemptions)
        self.plugin_errors.inc(stats.num_plugin_errors - last.num_plugin_errors)
        self.encoder_cache_queries.inc(stats.encoder_cache_queries - last.encoder_cache_queries)
        self.encoder_cache_hits.inc(stats.encoder_cache_hits - last.encoder_cache_hits)
        self.encoder_cache_usage_perc.set(stats.encoder_cache_usage)
        if stats.spec_num_drafts != last.spec_num_drafts:
            self._record_spec_decode(stats, last)
        if stats.kv_offload.num_blocks:
            self._record_kv_offload(stats.kv_offload, last.kv_offload)
        if step is not None:
            self._record_iteration(step)

    def _record_iteration(self, step: IterationStats) -> None:
        self.prompt_tokens.inc(step.num_prompt_tokens)
        self.prompt_tokens_cached.inc(step.num_cached_prompt_tokens)
        self.generation_tokens.inc(step.num_generation_tokens)
        if step.num_prompt_tokens or step.num_generation_tokens:
            self.iteration_tokens.observe(step.num_prompt_tokens + step.num_generation_tokens)
        for ttft in step.time_to_first_tokens:
            self.time_to_first_token.observe(ttft)
        if step.inter_token_latencies:
            self.inter_token_latency.observe_many(step.inter_token_latencies)
        for n in step.n_params:
            self.request_params_n.observe(n)
        for tokens in step.max_num_generation_tokens:
            self.request_max_num_generation_tokens.observe(tokens)
        for finished in step.finished_requests:
            self._request_done(finished)

    def _request_done(self, f: FinishedRequestStats) -> None:
        self.request_finished(f.finish_reason)
        self.request_prompt_tokens.observe(f.num_prompt_tokens)
        self.request_generation_tokens.observe(f.num_generation_tokens)
        if f.max_tokens_param:
            self.request_params_max_tokens.observe(f.max_tokens_param)
        self.e2e_request_latency.observe(f.e2e_latency)
        if f.queued_time is None:  # failed before its first token: no phases to time
            return
        self.request_prefill_kv_computed_tokens.observe(max(0, f.num_prompt_tokens - f.num_cached_tokens))
        self.request_queue_time.observe(f.queued_time)
        self.request_prefill_time.observe(f.prefill_time)
        self.request_decode_time.observe(f.decode_time)
        self.request_inference_time.observe(f.inference_time)
        self.request_time_per_output_token.observe(f.mean_time_per_output_token)

    def _record_kv_offload(self, tier: KVOffloadStats, last: KVOffloadStats) -> None:
        self.cpu_cache_usage_perc.set(tier.usage)
        self.num_requests_swapped.set(tier.num_swapped_requests)
        self.num_cpu_blocks.set(tier.num_blocks)
        self.num_free_cpu_blocks.set(tier.num_free_blocks)
        out, into = tier.blocks_swapped_out - last.blocks_swapped_out, tier.blocks_swapped_in - last.blocks_swapped_in
        self.kv_blocks_swapped_out.inc(out)
        self.kv_blocks_swapped_in.inc(into)
        self.kv_bytes_swapped_out.inc(out * tier.block_bytes)
        self.kv_bytes_swapped_in.inc(into * tier.block_bytes)
        self.num_swap_preemptions.inc(tier.num_swap_preemptions - last.num_swap_preemptions)
        self.cpu_prefix_cache_hits.inc((tier.hit_blocks - last.hit_blocks) * self.config.block_size)

    def _record_spec_decode(self, stats: SchedulerStats, last: SchedulerStats) -> None:
        self.spec_decode_num_drafts.inc(stats.spec_num_drafts - last.spec_num_drafts)
        self.spec_decode_num_draft_tokens.inc(stats.spec_num_draft_tokens - last.spec_num_draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(stats.spec_num_accepted_tokens - last.spec_num_accepted_tokens)
        before = last.spec_num_accepted_tokens_per_pos
        for pos, total in enumerate(stats.spec_num_accepted_tokens_per_pos):
            delta = total - (before[pos] if pos < len(before) else 0)
            if delta:
                self._spec_accepted_per_pos.labels(*self.label_values, str(pos)).inc(delta)

