"""The built-in stat loggers (Prometheus metrics from engine steps under vLLM's names, and
the periodic stats log line), the per-step stats the output processor gathers for them, and
a third party's stat logger fed by a real run."""

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagelm.engine.core_loop import SchedulerStats
from pagelm.engine.core_output import EngineCoreOutput
from pagelm.engine.iteration_stats import FinishedRequestStats, IterationStats
from pagelm.kv_offload import KVOffloadStats
from pagelm.engine.output_processor import OutputKind, OutputProcessor, ParentRequest, RequestState
from pagelm import hookimpl
from pagelm.config import EngineConfig
from pagelm.engine.async_llm import AsyncLLM
from pagelm.outputs import RequestMetrics
from pagelm.plugin_manager import get_plugin_manager
from pagelm.plugins.metrics.logging import LoggingStatLogger
from pagelm.plugins.metrics.prometheus import (
    TOKEN_LATENCY_BUCKETS,
    PrometheusStatLogger,
    TokenLatencyHistogram,
    build_1_2_5_buckets,
)
from pagelm.sampling_params import SamplingParams
from pagelm.stat_logger import StatLogger


def prometheus(num_kv_blocks: int = 0, **config) -> PrometheusStatLogger:
    stats = SchedulerStats(num_free_blocks=num_kv_blocks, num_kv_blocks=num_kv_blocks)
    return PrometheusStatLogger(EngineConfig(model="m", **config), "tiny", 512, stats)


def samples(m: PrometheusStatLogger) -> dict[str, float]:
    """Samples by name (+ finished_reason), buckets left out; every one labelled with the model
    and engine 0."""
    text = generate_latest(m.registry).decode()
    out = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if "le" in s.labels or not (s.name.startswith("vllm:") or s.name.startswith("pagelm:")):
                continue
            if "finished_reason" not in s.labels and s.name != "vllm:cache_config_info":
                assert s.labels == {"model_name": "tiny", "engine": "0"}, s
            reason = s.labels.get("finished_reason")
            out[s.name + (f"[{reason}]" if reason else "")] = s.value
    return out


def finished(n_tokens: int, reason: str = "length") -> FinishedRequestStats:
    m = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0,
                       last_token_time=13.0, finished_time=13.0, num_generation_tokens=n_tokens)
    return FinishedRequestStats.of(m, reason, num_prompt_tokens=3, num_cached_tokens=1, max_tokens_param=8, now=13.25)


def test_finished_request_splits_its_timeline_into_vllms_phases():
    f = finished(5)
    assert (f.e2e_latency, f.queued_time, f.prefill_time, f.decode_time, f.inference_time) == (3.25, 0.5, 0.5, 2.0, 2.5)
    assert f.mean_time_per_output_token == 0.5  # 2 s over the 4 tokens after the first
    assert finished(1).mean_time_per_output_token == 0.0


def test_a_request_that_failed_before_its_first_token_has_no_phases():
    m = RequestMetrics(arrival_time=10.0, num_generation_tokens=0)
    f = FinishedRequestStats.of(m, "error", 3, 0, None, now=10.5)
    assert f.e2e_latency == 0.5 and f.queued_time is None and f.mean_time_per_output_token is None


def test_step_updates_gauges_counters_and_request_histograms():
    m = prometheus()
    stats = SchedulerStats(num_running=3, num_waiting=2, num_free_blocks=6, num_kv_blocks=8,
                           prefix_cache_queries=40, prefix_cache_hits=16, num_preemptions=1)
    step = IterationStats()
    step.observe_tokens(1, None, now=11.0, arrival_time=10.0, num_prompt_tokens=3, num_cached_tokens=1)
    step.observe_tokens(2, 11.0, now=11.25, arrival_time=10.0, num_prompt_tokens=3, num_cached_tokens=1)
    m.record(stats, step)
    later = SchedulerStats(num_running=1, num_waiting=0, num_free_blocks=8, num_kv_blocks=8,
                           prefix_cache_queries=50, prefix_cache_hits=16, num_preemptions=1)
    done = IterationStats(num_generation_tokens=1, finished_requests=[finished(4)], n_params=[1],
                          max_num_generation_tokens=[4])
    m.record(later, done)
    s = samples(m)
    assert s["vllm:num_requests_running"] == 1 and s["vllm:num_requests_waiting"] == 0
    assert s["vllm:kv_cache_usage_perc"] == 0.0 == s["vllm:gpu_cache_usage_perc"]
    assert s["pagelm:num_free_kv_blocks"] == 8 and s["pagelm:num_kv_blocks"] == 8
    assert s["vllm:prefix_cache_queries_total"] == 50 and s["vllm:prefix_cache_hits_total"] == 16
    assert s["vllm:num_preemptions_total"] == 1
    assert s["vllm:generation_tokens_total"] == 4 and s["vllm:prompt_tokens_total"] == 3
    assert s["vllm:prompt_tokens_cached_total"] == 1
    assert s["vllm:iteration_tokens_total_count"] == 2 and s["vllm:iteration_tokens_total_sum"] == 7  # 3+3, then 1
    assert s["vllm:request_success_total[length]"] == 1
    assert s["vllm:request_success_total[stop]"] == 0 == s["vllm:request_success_total[abort]"]  # there from the start
    assert s["vllm:time_to_first_token_seconds_sum"] == 1.0
    assert s["vllm:inter_token_latency_seconds_count"] == 1 and s["vllm:inter_token_latency_seconds_sum"] == 0.25
    assert s["vllm:time_per_output_token_seconds_sum"] == 0.25  # vLLM's older name: the same observations
    assert s["vllm:e2e_request_latency_seconds_sum"] == 3.25
    assert s["vllm:request_queue_time_seconds_sum"] == 0.5
    assert s["vllm:request_prefill_time_seconds_sum"] == 0.5
    assert s["vllm:request_decode_time_seconds_sum"] == 2.0
    assert s["vllm:request_inference_time_seconds_sum"] == 2.5
    assert s["vllm:request_time_per_output_token_seconds_sum"] == pytest.approx(2 / 3)  # 2 s over 3 gaps
    assert s["vllm:request_prompt_tokens_sum"] == 3 and s["vllm:request_generation_tokens_sum"] == 4
    assert s["vllm:request_prefill_kv_computed_tokens_sum"] == 2  # 3 prompt tokens, 1 cached
    assert s["vllm:request_params_max_tokens_sum"] == 8 and s["vllm:request_params_n_sum"] == 1
    assert s["vllm:request_max_num_generation_tokens_sum"] == 4


def test_token_count_buckets_are_vllms_1_2_5_series():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(512) == [1, 2, 5, 10, 20, 50, 100, 200, 500]


def test_token_latency_histogram_buckets_as_prometheus_client_does():
    values = [0.0, 0.01, 0.0100001, 0.3, 0.31, 80.0, 81.0, 1e9]
    ours = TokenLatencyHistogram({"ours": "d"}, TOKEN_LATENCY_BUCKETS, ["tiny", "0"])
    ours.observe_many(values[:3])
    ours.observe_many(values[3:])
    registry = CollectorRegistry()
    registry.register(ours)
    reference = Histogram("ref", "d", ["model_name", "engine"], buckets=TOKEN_LATENCY_BUCKETS, registry=registry)
    for v in values:
        reference.labels("tiny", "0").observe(v)
    text = generate_latest(registry).decode()
    by_name = {f.name: {(s.name.rsplit("_", 1)[1], s.labels.get("le")): s.value for s in f.samples
                        if not s.name.endswith("_created")}
               for f in text_string_to_metric_families(text)}
    assert by_name["ours"] == by_name["ref"]
    assert by_name["ours"][("bucket", "0.01")] == 2 and by_name["ours"][("bucket", "+Inf")] == 8


def state(request_id="r", parent=None, index=0, prompt=(1, 2, 3)) -> RequestState:
    return RequestState(request_id, None, list(prompt), SamplingParams(max_tokens=8), None, OutputKind.DELTA,
                        arrival_time=0.0, parent=parent, index=index)


def test_output_processor_observes_one_inter_token_latency_per_output():
    processor = OutputProcessor()
    processor.add_request(state())
    steps = [IterationStats() for _ in range(5)]
    for i, step in enumerate(steps):
        out = EngineCoreOutput("r", [10 + i], num_cached_tokens=1, finish_reason="length" if i == 4 else None)
        processor.process_outputs([out], step)
    assert steps[0].num_prompt_tokens == 3 and steps[0].num_cached_prompt_tokens == 1
    assert len(steps[0].time_to_first_tokens) == 1 and steps[0].inter_token_latencies == []
    gaps = [g for step in steps for g in step.inter_token_latencies]
    assert len(gaps) == 4 and sum(step.num_prompt_tokens for step in steps) == 3
    [done] = steps[4].finished_requests
    assert sum(gaps) == pytest.approx(done.decode_time, abs=1e-9)
    assert done.num_generation_tokens == 5 and done.finish_reason == "length" and done.max_tokens_param == 8
    assert steps[4].n_params == [1] and steps[4].max_num_generation_tokens == [5]


def test_n_samples_count_as_requests_and_their_n_once():
    processor = OutputProcessor()
    parent = ParentRequest("p", 2)
    processor.add_request(state("0_p", parent, 0))
    processor.add_request(state("1_p", parent, 1))
    first, second = IterationStats(), IterationStats()
    processor.process_outputs([EngineCoreOutput("0_p", [5, 6, 7], finish_reason="stop"),
                               EngineCoreOutput("1_p", [5])], first)
    processor.process_outputs([EngineCoreOutput("1_p", [8], finish_reason="length")], second)
    assert len(first.finished_requests) == 1 and first.n_params == []
    assert [f.finish_reason for f in second.finished_requests] == ["length"]
    assert second.n_params == [2] and second.max_num_generation_tokens == [3]


def test_offline_processing_gathers_nothing():
    processor = OutputProcessor()
    processor.add_request(state())
    results, _ = processor.process_outputs([EngineCoreOutput("r", [1], finish_reason="length")])
    assert results[0].finished  # no stats object: nothing to fill


def test_cache_config_info_is_a_gauge_of_one_with_the_config_as_labels():
    m = prometheus(num_kv_blocks=8, block_size=32)
    m.engine_restarted(SchedulerStats(num_free_blocks=12, num_kv_blocks=12))  # a restarted core, more blocks
    [family] = [f for f in text_string_to_metric_families(generate_latest(m.registry).decode())
                if f.name == "vllm:cache_config_info"]
    assert [(s.labels, s.value) for s in family.samples] == [
        ({"block_size": "32", "cache_dtype": "auto", "enable_prefix_caching": "True",
          "gpu_memory_utilization": "0.9", "num_gpu_blocks": "12", "num_gpu_blocks_override": "None",
          "prefix_caching_hash_algo": "sha256", "engine": "0"}, 1.0)
    ]
    assert samples(m)["pagelm:engine_restarts_total"] == 1


def test_process_and_gc_collectors_are_registered():
    m = prometheus()
    names = {f.name for f in text_string_to_metric_families(generate_latest(m.registry).decode())}
    assert {"process_resident_memory_bytes", "process_cpu_seconds", "python_gc_collections", "python_info"} <= names


def test_stats_log_line_only_when_busy(caplog):
    idle = SchedulerStats(num_kv_blocks=8, num_free_blocks=8)
    log = LoggingStatLogger(EngineConfig(model="m"), "tiny", 512, idle)
    with caplog.at_level(logging.INFO, logger="pagelm"):
        log.log()
        assert caplog.records == []
        busy = SchedulerStats(num_running=2, num_kv_blocks=8, num_free_blocks=4)
        log.record(busy, IterationStats(num_generation_tokens=2))
        log.log()
    [record] = caplog.records
    line = record.getMessage()
    assert "generation throughput" in line and "running: 2 reqs" in line and "KV cache usage: 50.0%" in line


class Recorder(StatLogger):
    """A third party's stat logger: keeps what it is handed."""

    name = "recorder"
    made: list["Recorder"] = []

    def __init__(self, config, model_name, max_model_len, stats):
        super().__init__(config, model_name, max_model_len, stats)
        self.start, self.steps, self.aborted = stats, [], []
        Recorder.made.append(self)

    def record(self, stats, iteration=None):
        self.steps.append((stats, iteration))

    def request_finished(self, reason, count=1):
        self.aborted.append((reason, count))


class Raises(StatLogger):
    """A third party's broken stat logger."""

    name = "raises"

    def record(self, stats, iteration=None):
        raise RuntimeError("record: boom")


class RecorderPlugin:
    def __init__(self, *loggers):
        self.loggers = loggers or (Recorder,)

    @hookimpl
    def pagelm_register_stat_loggers(self, registry):
        for cls in self.loggers:
            registry.add(cls.name, cls)


def run_two_requests(llama_dir, *loggers):
    """Two greedy 5-token requests through an in-process AsyncLLM with ``loggers`` registered
    as a plugin; returns the engine (shut down) and the outputs' token ids."""
    pm = get_plugin_manager()
    pm.register(RecorderPlugin(*loggers), name="test-recorder")
    Recorder.made.clear()
    loop = asyncio.new_event_loop()
    config = EngineConfig.from_kwargs(str(llama_dir), num_kv_blocks=64, max_model_len=256)
    try:
        engine = AsyncLLM(config, engine_process=False, model_name="tiny")
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

        async def run(request_id):
            outs = [o async for o in engine.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, request_id)]
            return [t for o in outs for t in o.outputs[0].token_ids]

        async def both():
            return await asyncio.gather(run("a"), run("b"))

        tokens = loop.run_until_complete(both())
        engine.shutdown()
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
        pm.unregister("test-recorder")
    return engine, config, tokens


def test_hook_pagelm_register_stat_loggers(llama_dir):
    """A third party's stat logger, registered through the hook, receives the stats of a real
    run beside the built-in ones."""
    engine, config, _ = run_two_requests(llama_dir)
    assert sorted(engine.stat_loggers) == ["logging", "prometheus", "recorder"]  # beside the built-ins
    [rec] = Recorder.made
    assert rec.model_name == "tiny" and rec.max_model_len == 256 and rec.config is config
    assert rec.start.num_kv_blocks == 64 == rec.start.num_free_blocks
    iterations = [it for _, it in rec.steps if it is not None]
    assert sum(it.num_generation_tokens for it in iterations) == 10  # 2 requests x 5 tokens
    assert sum(it.num_prompt_tokens for it in iterations) == 8
    finished = [f for it in iterations for f in it.finished_requests]
    assert sorted((f.finish_reason, f.num_generation_tokens) for f in finished) == [("length", 5), ("length", 5)]
    assert rec.steps[-1][0].num_kv_blocks == 64 and rec.aborted == []
    # The prometheus logger saw the same steps.
    prom = samples(engine.stat_loggers["prometheus"])
    assert prom["vllm:generation_tokens_total"] == 10 and prom["vllm:request_success_total[length]"] == 2


def test_a_raising_stat_logger_is_dropped_and_the_engine_serves_on(llama_dir, caplog):
    with caplog.at_level(logging.ERROR, logger="pagelm"):
        engine, _, tokens = run_two_requests(llama_dir, Raises, Recorder)
    assert "raises" not in engine.stat_loggers and "recorder" in engine.stat_loggers
    assert "stat logger 'raises' raised in record and is dropped" in caplog.text
    assert [len(t) for t in tokens] == [5, 5] and tokens[0] == tokens[1]  # same greedy prompt
    [rec] = Recorder.made
    assert sum(it.num_generation_tokens for _, it in rec.steps if it is not None) == 10


class FailsToStart(StatLogger):
    name = "fails_to_start"

    def __init__(self, config, model_name, max_model_len, stats):
        raise RuntimeError("no metrics backend reachable")

    def record(self, stats, iteration=None):
        pass


def test_a_stat_logger_that_fails_to_start_fails_the_engine_and_shuts_its_core_down(llama_dir, monkeypatch):
    import subprocess

    started = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", popen)
    pm = get_plugin_manager()
    pm.register(RecorderPlugin(FailsToStart), name="test-fails")
    try:
        with pytest.raises(RuntimeError, match="no metrics backend reachable"):
            AsyncLLM.from_model(str(llama_dir), num_kv_blocks=64, max_model_len=256)
    finally:
        pm.unregister("test-fails")
    [core_proc] = started  # the engine core's process was shut down, not left to the garbage
    assert core_proc.poll() == 0  # collector's finalizer (which terminates it: -SIGTERM)


def test_cpu_tier_metrics_count_copies_bytes_hits_and_usage():
    m = prometheus(block_size=4)
    start = KVOffloadStats(num_blocks=10, num_free_blocks=10, block_bytes=1024)
    m.record(SchedulerStats(num_free_blocks=8, num_kv_blocks=8, kv_offload=start))
    later = KVOffloadStats(num_blocks=10, num_free_blocks=6, block_bytes=1024, blocks_swapped_out=5,
                           blocks_swapped_in=3, num_swap_preemptions=1, hit_blocks=2, num_swapped_requests=1)
    m.record(SchedulerStats(num_free_blocks=8, num_kv_blocks=8, kv_offload=later))
    s = samples(m)
    assert s["vllm:cpu_cache_usage_perc"] == pytest.approx(0.4) and s["vllm:num_requests_swapped"] == 1
    assert s["pagelm:num_cpu_blocks"] == 10 and s["pagelm:num_free_cpu_blocks"] == 6
    assert s["pagelm:kv_blocks_swapped_out_total"] == 5 and s["pagelm:kv_blocks_swapped_in_total"] == 3
    assert s["pagelm:kv_bytes_swapped_out_total"] == 5 * 1024 and s["pagelm:kv_bytes_swapped_in_total"] == 3 * 1024
    assert s["pagelm:num_swap_preemptions_total"] == 1
    assert s["pagelm:cpu_prefix_cache_hits_total"] == 2 * 4  # tokens: 2 blocks of 4


def test_scheduler_stats_with_a_cpu_tier_cross_the_process_boundary():
    import msgpack

    from pagelm.engine.core_loop import decode_stats, encode_stats

    stats = SchedulerStats(num_running=2, kv_offload=KVOffloadStats(num_blocks=10, blocks_swapped_out=3, hit_blocks=1))
    assert decode_stats(msgpack.unpackb(msgpack.packb(encode_stats(stats)))) == stats
