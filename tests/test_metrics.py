"""Prometheus metrics from engine steps, and the periodic stats log line."""

import logging

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagelm.engine.core_loop import SchedulerStats
from pagelm.engine.core_output import EngineCoreOutput
from pagelm.metrics import EngineMetrics, StatsLogger
from pagelm.outputs import CompletionOutput, RequestMetrics, RequestOutput


def samples(m: EngineMetrics) -> dict[str, float]:
    text = generate_latest(m.registry).decode()
    return {
        s.name + ("" if "finished_reason" not in s.labels else f"[{s.labels['finished_reason']}]"): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if "le" not in s.labels
    }


def finished_output(n_tokens: int) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0,
                             last_token_time=13.0, finished_time=13.0, num_generation_tokens=n_tokens)
    return RequestOutput("r", None, [1, 2, 3], None, [CompletionOutput(0, "t", [4] * n_tokens, None, None, "length")],
                         True, metrics)


def test_step_updates_gauges_and_counter_deltas():
    m = EngineMetrics("tiny")
    stats = SchedulerStats(num_running=3, num_waiting=2, num_free_blocks=6, num_kv_blocks=8,
                           prefix_cache_queries=40, prefix_cache_hits=16, num_preemptions=1)
    outs = [EngineCoreOutput("a", [1]), EngineCoreOutput("b", [2, 3])]
    assert m.record_step(stats, outs, []) == 3
    later = SchedulerStats(num_running=1, num_waiting=0, num_free_blocks=8, num_kv_blocks=8,
                           prefix_cache_queries=50, prefix_cache_hits=16, num_preemptions=1)
    m.record_step(later, [EngineCoreOutput("a", [5])], [finished_output(5)])
    s = samples(m)
    assert s["pagelm:num_requests_running"] == 1 and s["pagelm:num_requests_waiting"] == 0
    assert s["pagelm:kv_cache_usage_perc"] == 0.0 and s["pagelm:num_free_kv_blocks"] == 8
    assert s["pagelm:prefix_cache_queries_total"] == 50 and s["pagelm:prefix_cache_hits_total"] == 16
    assert s["pagelm:num_preemptions_total"] == 1
    assert s["pagelm:generation_tokens_total"] == 4 and s["pagelm:prompt_tokens_total"] == 3
    assert s["pagelm:request_success_total[length]"] == 1
    assert s["pagelm:time_to_first_token_seconds_sum"] == 1.0
    assert s["pagelm:e2e_request_latency_seconds_sum"] == 3.0
    assert s["pagelm:request_queue_time_seconds_sum"] == 0.5
    assert s["pagelm:inter_token_latency_seconds_sum"] == 0.5  # 2 s over 4 gaps


def test_stats_log_line_only_when_busy(caplog):
    m = EngineMetrics("tiny")
    log = StatsLogger(m)
    with caplog.at_level(logging.INFO, logger="pagelm"):
        log.log(SchedulerStats(num_kv_blocks=8, num_free_blocks=8))
        assert caplog.records == []
        busy = SchedulerStats(num_running=2, num_kv_blocks=8, num_free_blocks=4)
        m.record_step(busy, [EngineCoreOutput("a", [1, 2])], [])
        log.log(busy)
    [record] = caplog.records
    line = record.getMessage()
    assert "generation throughput" in line and "running: 2 reqs" in line and "KV cache usage: 50.0%" in line
