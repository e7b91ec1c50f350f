"""``/metrics`` of a real ``pagelm serve`` after real requests through the official ``openai``
client: vLLM's metric names, labels and meanings, the HTTP and process metrics, checked
against what the requests did."""

import os
import signal
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_server import API_KEY, AUTH, MODEL, start_server, stop_server

# What vLLM's Grafana dashboards, alerts and autoscalers query (vLLM V1 names; the two
# deprecated ones are what its example dashboard still plots).
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:prompt_tokens_cached": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:spec_decode_num_drafts": "counter",
    "vllm:spec_decode_num_draft_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_prefill_kv_computed_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
}
# prometheus-fastapi-instrumentator's defaults (vLLM's server), then the default collectors.
SERVER_METRICS = {
    "http_requests": "counter",  # a counter family: its samples are http_requests_total
    "http_request_duration_seconds": "histogram",
    "http_request_duration_highr_seconds": "histogram",
    "http_request_size_bytes": "summary",
    "http_response_size_bytes": "summary",
    "process_resident_memory_bytes": "gauge",
    "process_cpu_seconds": "counter",
    "process_open_fds": "gauge",
    "python_gc_collections": "counter",
    "python_info": "gauge",
}


@pytest.fixture(scope="module")
def served(llama_dir):
    """(the server process, its URL)."""
    proc, url = start_server(
        str(llama_dir), "--api-key", API_KEY, "--served-model-name", MODEL,
        "--num-kv-blocks", "512", "--max-model-len", "512", "--block-size", "16",
    )
    try:
        yield proc, url
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def server(served):
    return served[1]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


def scrape(server) -> dict[str, dict]:
    """Families by name: their type and samples (name, labels) -> value."""
    text = httpx.get(f"{server}/metrics", headers=AUTH).text
    return {
        f.name: {"type": f.type, "samples": {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples}}
        for f in text_string_to_metric_families(text)
    }


def value(families, sample: str, **labels) -> float:
    """One sample of an engine metric (labels model_name and engine 0 added), or 0 if absent."""
    if sample.startswith("vllm:") or sample.startswith("pagelm:"):
        labels = {"model_name": MODEL, "engine": "0", **labels}
    key = (sample, tuple(sorted(labels.items())))
    return next((f["samples"][key] for f in families.values() if key in f["samples"]), 0.0)


def delta(before, after, sample: str, **labels) -> float:
    return value(after, sample, **labels) - value(before, sample, **labels)


def test_every_vllm_dashboard_metric_is_there_with_vllms_type_and_labels(server):
    families = scrape(server)
    for name, kind in {**VLLM_METRICS, **SERVER_METRICS}.items():
        assert name in families, name
        assert families[name]["type"] == kind, name
    for name in VLLM_METRICS:
        for (sample, labels), _ in families[name]["samples"].items():
            labels = dict(labels)
            if name != "vllm:cache_config_info":
                assert labels["model_name"] == MODEL and labels["engine"] == "0", (sample, labels)
    reasons = {dict(labels)["finished_reason"] for _, labels in families["vllm:request_success"]["samples"]}
    assert reasons == {"stop", "length", "abort", "error"}  # there before the first one finishes
    assert not any(name.startswith("pagelm:") and name[7:] in {v[5:] for v in VLLM_METRICS} for name in families)


def test_a_completion_moves_every_request_metric_by_what_it_did(client, server):
    before = scrape(server)
    r = client.completions.create(model=MODEL, prompt="count the tokens " * 3, max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = scrape(server)
    prompt = r.usage.prompt_tokens
    assert r.usage.completion_tokens == 7
    d = lambda sample, **labels: delta(before, after, sample, **labels)  # noqa: E731
    assert d("vllm:prompt_tokens_total") == prompt and d("vllm:generation_tokens_total") == 7
    assert d("vllm:request_prompt_tokens_sum") == prompt and d("vllm:request_generation_tokens_sum") == 7
    assert d("vllm:request_prompt_tokens_count") == 1
    assert d("vllm:request_params_max_tokens_sum") == 7 and d("vllm:request_params_n_sum") == 1
    assert d("vllm:request_max_num_generation_tokens_sum") == 7
    assert d("vllm:iteration_tokens_total_sum") == prompt + 7
    assert d("vllm:request_success_total", finished_reason="length") == 1
    assert d("vllm:request_success_total", finished_reason="stop") == 0
    assert d("vllm:prefix_cache_queries_total") >= prompt
    # Per token: one inter-token latency for each token after the first (no drafts here).
    assert d("vllm:inter_token_latency_seconds_count") == 6
    assert d("vllm:time_per_output_token_seconds_count") == 6
    assert d("vllm:time_per_output_token_seconds_sum") == d("vllm:inter_token_latency_seconds_sum")
    # Per request: one each, and the phases add up.
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
              "request_time_per_output_token_seconds", "request_prefill_kv_computed_tokens"):
        assert d(f"vllm:{h}_count") == 1, h
    decode = d("vllm:request_decode_time_seconds_sum")
    assert d("vllm:inter_token_latency_seconds_sum") == pytest.approx(decode, abs=1e-6)
    assert d("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(decode / 6, abs=1e-6)
    assert d("vllm:request_inference_time_seconds_sum") == pytest.approx(
        d("vllm:request_prefill_time_seconds_sum") + decode, abs=1e-6)
    assert d("vllm:e2e_request_latency_seconds_sum") >= d("vllm:request_queue_time_seconds_sum") + \
        d("vllm:request_inference_time_seconds_sum") - 1e-6
    assert 0 < d("vllm:time_to_first_token_seconds_sum") <= d("vllm:e2e_request_latency_seconds_sum")
    assert value(after, "vllm:num_requests_running") == 0 and value(after, "vllm:kv_cache_usage_perc") == 0.0


def test_streamed_samples_of_one_request_count_as_requests_and_its_n_once(client, server):
    before = scrape(server)
    stream = client.completions.create(model=MODEL, prompt="two ways", max_tokens=5, n=2, stream=True,
                                       extra_body={"ignore_eos": True})
    assert sum(1 for _ in stream) > 0
    after = scrape(server)
    assert delta(before, after, "vllm:request_success_total", finished_reason="length") == 2
    assert delta(before, after, "vllm:generation_tokens_total") == 10
    assert delta(before, after, "vllm:inter_token_latency_seconds_count") == 8
    assert delta(before, after, "vllm:request_params_n_count") == 1
    assert delta(before, after, "vllm:request_params_n_sum") == 2
    assert delta(before, after, "vllm:request_max_num_generation_tokens_sum") == 5


def test_cache_config_info_carries_the_cache_configuration(server):
    [(labels, one)] = [(dict(labels), v) for (_, labels), v in scrape(server)["vllm:cache_config_info"]["samples"].items()]
    assert one == 1.0
    assert labels["block_size"] == "16" and labels["num_gpu_blocks"] == "512" and labels["engine"] == "0"
    assert labels["enable_prefix_caching"] == "True" and labels["cache_dtype"] == "auto"


def test_http_requests_are_counted_by_handler_method_and_status_class(client, server):
    before = scrape(server)
    client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    client.models.retrieve(MODEL)
    assert httpx.post(f"{server}/v1/completions", json={"prompt": "x"}).status_code == 401
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=-1)
    assert httpx.get(f"{server}/no/such/route", headers=AUTH).status_code == 404
    after = scrape(server)

    def d(sample, **labels):
        return delta(before, after, sample, **labels)

    assert d("http_requests_total", handler="/v1/completions", method="POST", status="2xx") == 1
    assert d("http_requests_total", handler="/v1/completions", method="POST", status="4xx") == 2  # 401, 400
    assert d("http_requests_total", handler="/v1/models/{model_id:path}", method="GET", status="2xx") == 1
    assert d("http_requests_total", handler="none", method="GET", status="4xx") == 1
    assert d("http_request_duration_seconds_count", handler="/v1/completions", method="POST") == 3
    assert d("http_request_duration_highr_seconds_count") == 5
    assert d("http_request_size_bytes_count", handler="/v1/completions") == 3
    assert d("http_request_duration_seconds_sum", handler="/v1/completions", method="POST") > 0
    handlers = {dict(labels)["handler"] for _, labels in after["http_requests"]["samples"]}
    assert not handlers & {"/metrics", "/health", "/version"}  # scrapes and probes are not traffic


def test_process_metrics_describe_the_serving_process(server):
    families = scrape(server)
    assert value(families, "process_resident_memory_bytes") > 10 * 2**20
    assert value(families, "process_cpu_seconds_total") > 0
    assert sum(v for (name, _), v in families["python_gc_collections"]["samples"].items()) > 0


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (field 3 onwards)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def core_pid(server_pid: int) -> int:
    """The engine core: the server's child process running pagelm.engine.core_proc."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(_stat(int(entry))[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, IndexError):
            continue
        if ppid == server_pid and b"pagelm.engine.core_proc" in cmdline:
            return int(entry)
    raise AssertionError(f"no engine core process under {server_pid}")


def start_time(pid: int) -> float:
    """The process's start, in seconds since the epoch, as the process collector computes it."""
    with open("/proc/stat") as f:
        boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
    return float(_stat(pid)[19]) / os.sysconf("SC_CLK_TCK") + boot


def rss(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return float(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def core_metric(families, sample: str) -> float:
    """A sample of the engine core's process metrics (no labels: one process)."""
    key = (f"pagelm:engine_core_process_{sample}", ())
    return next(f["samples"][key] for f in families.values() if key in f["samples"])


def test_engine_core_process_metrics_describe_the_core_process(served):
    """The model and every forward pass live in the engine core's process: its memory and CPU
    time are on /metrics beside the API process's, read from its own /proc entry."""
    proc, server = served
    core = core_pid(proc.pid)
    families = scrape(server)
    assert families["pagelm:engine_core_process_resident_memory_bytes"]["type"] == "gauge"
    assert families["pagelm:engine_core_process_cpu_seconds"]["type"] == "counter"
    assert core_metric(families, "start_time_seconds") == pytest.approx(start_time(core), abs=0.02)
    assert value(families, "process_start_time_seconds") == pytest.approx(start_time(proc.pid), abs=0.02)
    assert core_metric(families, "resident_memory_bytes") == pytest.approx(rss(core), rel=0.05)
    assert core_metric(families, "cpu_seconds_total") > 0.5  # it loaded torch and the model
    assert core_metric(families, "open_fds") > 0


def test_engine_core_process_metrics_follow_a_restarted_core(served):
    """Last in the module: kills the engine core. The server starts a new one, whose process
    the metrics then describe."""
    proc, server = served
    dead = core_pid(proc.pid)
    os.kill(dead, signal.SIGKILL)
    deadline = time.time() + 120
    while True:
        try:
            fresh = core_pid(proc.pid)
            if fresh != dead and httpx.get(f"{server}/health", timeout=1).status_code == 200:
                break
        except (AssertionError, httpx.HTTPError):
            pass
        assert time.time() < deadline, "the engine core was not restarted"
        time.sleep(0.2)
    families = scrape(server)
    assert core_metric(families, "start_time_seconds") == pytest.approx(start_time(fresh), abs=0.02)
    assert core_metric(families, "resident_memory_bytes") == pytest.approx(rss(fresh), rel=0.05)
