"""`pagelm simulate`: traces, the replay through the real scheduler, the figures it reports,
and the CLI (trace generation, table, JSON, plot)."""

import json

import numpy as np
import pytest

from pagelm.cli import main as cli_main
from pagelm.plugins.sim import SimConfig, TraceRequest, load_trace, make_trace, save_trace, simulate


def test_trace_round_trips_through_jsonl(tmp_path):
    trace = [TraceRequest(0.5, 10, 3), TraceRequest(0.1, 20, 5, priority=2, prefix_id="sys", prefix_len=8)]
    save_trace(trace, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == sorted(trace, key=lambda r: r.arrival_time)


@pytest.mark.parametrize("line, message", [
    ('{"arrival_time": 0, "prompt_len": 4}', r"t.jsonl:2: missing fields \['output_len'\]"),
    ('{"arrival_time": 0, "prompt_len": 4, "output_len": 1, "tenant": "x"}', r"unknown fields \['tenant'\]"),
    ('{"arrival_time": 0, "prompt_len": 4, "output_len": 0}', "output_len must be >= 1"),
    ('{"arrival_time": 0, "prompt_len": 4, "output_len": 1, "prefix_len": 9}', "prefix_len must be in"),
    ("not json", "t.jsonl:2: not JSON"),
])
def test_bad_trace_lines_are_named(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_time": 0, "prompt_len": 4, "output_len": 1}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_trace(path)


def test_bursty_trace_is_reproducible_and_has_the_documented_shape():
    trace = make_trace("bursty", 2000, seed=3)
    assert trace == make_trace("bursty", 2000, seed=3)
    assert trace != make_trace("bursty", 2000, seed=4)
    high = sum(r.priority == 0 for r in trace) / len(trace)
    shared = sum(r.prefix_id is not None for r in trace) / len(trace)
    outputs = np.array([r.output_len for r in trace])
    assert 0.07 < high < 0.13 and 0.35 < shared < 0.45
    assert outputs.mean() > 2 * np.median(outputs)  # heavy tail
    gaps = np.diff([r.arrival_time for r in trace])
    assert gaps.std() > 1.5 * gaps.mean()  # bursty, not Poisson (std == mean)


def test_every_request_finishes_with_its_output_length():
    trace = make_trace("poisson", 200, seed=0)
    res = simulate(trace, "fcfs", SimConfig(num_kv_blocks=2048))
    assert not np.isnan(res.finish).any()
    assert (res.ttft > 0).all() and (res.e2e >= res.ttft).all()
    assert res.output_tokens == sum(r.output_len for r in trace)
    assert res.num_steps == len(res.timeline.time)


def test_shared_prefixes_hit_the_prefix_cache():
    trace = [TraceRequest(i * 0.01, 64, 4, prefix_id="sys", prefix_len=48) for i in range(20)]
    res = simulate(trace, "fcfs")
    # 20 x 64 prompt tokens; after the first, 48 of each come from the cache.
    assert res.prefix_cache_hit_rate == pytest.approx(19 * 48 / (20 * 64))


def test_a_small_pool_preempts_and_everything_still_finishes():
    trace = [TraceRequest(0.0, 100, 200) for _ in range(8)]
    res = simulate(trace, "fcfs", SimConfig(num_kv_blocks=40, enable_prefix_caching=False))
    assert res.num_preemptions > 0
    assert not np.isnan(res.finish).any()


@pytest.fixture(scope="module")
def bursty_results():
    trace = make_trace("bursty", 1500, seed=0)
    return {p: simulate(trace, p) for p in ("fcfs", "priority", "sjf")}


def test_sjf_lowers_mean_latency_on_a_bursty_heavy_tailed_trace(bursty_results):
    assert bursty_results["sjf"].e2e.mean() < 0.9 * bursty_results["fcfs"].e2e.mean()


def test_priority_lowers_the_high_class_p99_ttft(bursty_results):
    high = {p: r.ttft_p99_by_priority()[0] for p, r in bursty_results.items()}
    assert high["priority"] < 0.5 * high["fcfs"]


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown scheduling policy 'nope'; registered: .*fcfs"):
        simulate([TraceRequest(0, 4, 1)], "nope")


def test_cli_makes_a_trace_and_reports_every_policy(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    assert cli_main(["simulate", "--make-trace", "bursty", "--num-requests", "300", "--seed", "1", "-o", str(trace)]) == 0
    assert len(load_trace(trace)) == 300
    figures = tmp_path / "figures.json"
    assert cli_main(["simulate", "--trace", str(trace), "--policy", "fcfs,sjf,priority", "--json", str(figures)]) == 0
    out = capsys.readouterr().out
    table = [line.split()[0] for line in out.splitlines() if line.strip()]
    assert {"fcfs", "sjf", "priority"} <= set(table)
    assert "TTFT p99 by priority class" in out and "simulator speed" in out
    data = json.loads(figures.read_text())
    assert set(data) == {"fcfs", "sjf", "priority"}
    assert data["fcfs"]["requests"] == 300 and data["fcfs"]["ttft_p50"] <= data["fcfs"]["ttft_p99"]


def test_cli_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    trace = tmp_path / "trace.jsonl"
    save_trace(make_trace("poisson", 100, seed=0), trace)
    png = tmp_path / "out.png"
    assert cli_main(["simulate", "--trace", str(trace), "--policy", "fcfs,sjf", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
