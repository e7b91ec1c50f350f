"""The OpenAI-compatible server, tested as users meet it: a real `pagelm serve` on 127.0.0.1
and the official `openai` client."""

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "tiny-llama"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pagelm_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from pagelm.cli import main; sys.exit(main())", *args]


def start_server(*serve_args: str, timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """``pagelm serve *serve_args`` on a free port of 127.0.0.1: the process and its base URL
    once /health answers 200. A start that fails or times out (or is interrupted) leaves no
    process behind: the server, and what it started, are killed and reaped before it raises."""
    port = free_port()
    proc = subprocess.Popen(
        pagelm_cmd("serve", *serve_args, "--port", str(port), "--no-access-log"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group: its engine core goes with it
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_healthy(proc, url, timeout)
    except BaseException:
        _kill_process_group(proc)
        raise
    return proc, url


def _wait_until_healthy(proc: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"pagelm serve exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() >= deadline:
            raise AssertionError(f"pagelm serve did not answer /health within {timeout} s")
        time.sleep(0.2)


def _kill_process_group(proc: subprocess.Popen) -> None:
    """SIGKILL the server's process group (it leads it), reap the server, close its pipe."""
    with contextlib.suppress(ProcessLookupError):  # every member already gone
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()


def stop_server(proc: subprocess.Popen, timeout: float = 20) -> None:
    """Stop a started server: SIGTERM (it shuts its engine core down), then, past ``timeout``
    seconds or once it has exited, SIGKILL whatever is left of its process group."""
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout)
    _kill_process_group(proc)


@contextlib.contextmanager
def running_server(*serve_args: str):
    """``start_server``, stopped afterwards."""
    proc, url = start_server(*serve_args)
    try:
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def server(llama_dir):
    with running_server(
        str(llama_dir), "--api-key", API_KEY, "--served-model-name", MODEL,
        "--num-kv-blocks", "512", "--max-model-len", "512", "--log-stats-interval", "1",
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


def metrics(server) -> dict[str, float]:
    """Samples by name (+ labels other than model_name and engine)."""
    text = httpx.get(f"{server}/metrics", headers=AUTH).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine", "le"))
            if "le" in s.labels:
                continue
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def wait_for(predicate, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


# ---- the test helper itself ------------------------------------------------------------------


@pytest.fixture
def started_processes(monkeypatch) -> list[subprocess.Popen]:
    """Every process ``subprocess.Popen`` starts during the test."""
    started, real_popen = [], subprocess.Popen

    class Recorded(real_popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    return started


def assert_gone(proc: subprocess.Popen) -> None:
    """Reaped, and nothing left in its process group (its engine core included)."""
    assert proc.returncode is not None and proc.stdout.closed
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)


def test_a_server_that_exits_at_start_leaves_no_process(tmp_path, started_processes):
    with pytest.raises(AssertionError, match="pagelm serve exited with"):
        start_server(str(tmp_path / "no-such-model"))
    [proc] = started_processes
    assert_gone(proc)


def test_a_server_that_does_not_come_up_in_time_is_killed_and_reaped(llama_dir, started_processes):
    with pytest.raises(AssertionError, match=r"did not answer /health within 0\.5 s"):
        start_server(str(llama_dir), timeout=0.5)
    [proc] = started_processes
    assert proc.returncode == -signal.SIGKILL  # still starting: it was killed, not left running
    assert_gone(proc)


# ---- the basics -------------------------------------------------------------------------------


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.completion_tokens == 7 and r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_chat_completion(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_completion_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.completion_tokens == 5


def test_streamed_text_equals_non_streamed_for_the_same_seed(client):
    kw = dict(model=MODEL, prompt="import json\n", max_tokens=24, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_stream_equals_non_streamed_and_reports_usage(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "tell me"}], max_tokens=16, temperature=0.8,
              seed=5, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_n_two_gives_two_choices(client):
    r = client.completions.create(model=MODEL, prompt="x", n=2, max_tokens=6, temperature=1.0, seed=3,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 12
    chunks = list(client.completions.create(model=MODEL, prompt="x", n=2, max_tokens=6, temperature=1.0, seed=3,
                                            stream=True, extra_body={"ignore_eos": True}))
    streamed = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] += choice.text
    assert streamed == {c.index: c.text for c in r.choices}


def test_stop_string_cuts_streamed_and_full_text_alike(client):
    base = client.completions.create(model=MODEL, prompt="x = ", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[4:7]
    assert stop.strip()
    kw = dict(model=MODEL, prompt="x = ", max_tokens=16, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert r.choices[0].text == base[: base.find(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert streamed == r.choices[0].text


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="def", max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) <= 3 for t in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    assert all(abs(max(t.values()) - x) < 1e-4 for t, x in zip(lp.top_logprobs, lp.token_logprobs))
    assert "".join(lp.tokens) == r.choices[0].text


def test_echo_returns_prompt_and_its_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=3, temperature=0, echo=True,
                                  logprobs=1, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text.startswith("def add(a, b):")
    assert len(c.logprobs.tokens) == r.usage.prompt_tokens + 3
    assert c.logprobs.token_logprobs[0] is None
    assert all(x is not None for x in c.logprobs.token_logprobs[1:])


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == r.choices[0].message.content


def test_usage_reports_cached_prompt_tokens(client):
    prompt = "the same long prefix " * 8  # several full KV blocks
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 16


def test_priority_and_cache_salt_are_accepted(client):
    prompt = "salted prefix words " * 8
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "a"})
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                  extra_body={"cache_salt": "b", "priority": 1})
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # another salt: no sharing


# ---- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n"),
        (dict(n=100000), "n"),  # beyond --max-n (128): n = 100000 held the server for minutes
        (dict(n=2**63), "n"),
        (dict(logprobs=50), "logprobs"),
        (dict(extra_body={"top_k": -3}), "top_k"),
        # Beyond int64: it used to pass and then kill the engine core for everyone.
        (dict(extra_body={"top_k": 2**63}), "top_k"),
        (dict(seed=2**64 - 1, n=2), "seed"),
        (dict(extra_body={"priority": 2**63}), "priority"),
        (dict(extra_body={"extra_args": ["not", "a", "dict"]}), "extra_args"),
        (dict(extra_body={"min_p": 2}), "min_p"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(max_tokens=600), "max_tokens"),
        (dict(prompt="word " * 600), "prompt"),
        (dict(temperature="hot"), "temperature"),
        (dict(extra_body={"stop_token_ids": [2**64]}), "stop_token_ids"),
        (dict(extra_body={"min_tokens": -1}), "min_tokens"),
        # Typed strictly, as vLLM: a string is not coerced to a number or a boolean.
        (dict(max_tokens="16"), "max_tokens"),
        (dict(logprobs="yes"), "logprobs"),
        (dict(extra_body={"echo": "true"}), "echo"),
        (dict(n=2.0), "n"),
    ],
)
def test_invalid_parameters_are_400_naming_the_parameter(client, server, kwargs, param):
    body = {"model": MODEL, "prompt": "hi", **kwargs.pop("extra_body", {}), **kwargs}
    r = httpx.post(f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert set(err) == {"message", "type", "param", "code"}


def test_completion_max_tokens_null_means_16(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": None, "ignore_eos": True, "temperature": 0}
    r = httpx.post(f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


def test_an_unknown_field_is_a_400_naming_it(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "priority_": 1}
    r = httpx.post(f"{server}/v1/completions", json=body, headers=headers)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "priority_" and "unknown field(s): priority_" in err["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "guided_jsn": {}}
    r = httpx.post(f"{server}/v1/chat/completions", json=chat, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_jsn"


def test_fields_the_openai_api_defines_are_accepted(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_completion_tokens=2, store=False,
        parallel_tool_calls=False, metadata={"k": "v"}, user="u1", service_tier="auto",
    )
    assert r.usage.completion_tokens <= 2


def test_allow_unknown_fields_ignores_them(llama_dir):
    with running_server(str(llama_dir), "--num-kv-blocks", "64", "--max-model-len", "128", "--allow-unknown-fields") as url:
        body = {"prompt": "hi", "max_tokens": 2, "priority_": 1, "some_vendor_extra": {"a": 1}}
        r = httpx.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_extra_args_are_accepted_for_plugins(client):
    r = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=2, extra_body={"extra_args": {"deadline_ms": 50, "tenant": "a"}}
    )
    assert r.choices[0].finish_reason in ("length", "stop")


def test_openai_client_sees_bad_request_error_and_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_p=7)
    assert e.value.status_code == 400 and e.value.param == "top_p"
    ok = client.completions.create(model=MODEL, prompt="still here", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert e.value.code == "model_not_found" and e.value.param == "model"


def test_missing_api_key_is_401(server):
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/health").status_code == 200  # health needs no key


# ---- other endpoints --------------------------------------------------------------------------


def test_tokenize_detokenize_and_version(server, llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    r = httpx.post(f"{server}/tokenize", json={"prompt": "def f(x):"}, headers=AUTH).json()
    assert r["tokens"] == tok.encode("def f(x):") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    assert httpx.post(f"{server}/detokenize", json={"tokens": r["tokens"]}, headers=AUTH).json()["prompt"] == "def f(x):"
    chat = httpx.post(f"{server}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, headers=AUTH).json()
    assert chat["tokens"] == tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    import pagelm

    assert httpx.get(f"{server}/version", headers=AUTH).json() == {"version": pagelm.__version__}


def test_metrics_counters_move(client, server):
    before = metrics(server)
    client.completions.create(model=MODEL, prompt="count me " * 5, max_tokens=4, extra_body={"ignore_eos": True})
    after = metrics(server)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 4
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    length = "vllm:request_success_total{finished_reason=length}"
    assert after[length] == before.get(length, 0) + 1
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert after[f"vllm:{h}_count"] == before[f"vllm:{h}_count"] + 1, h
    # One inter-token latency per token after the first.
    assert after["vllm:inter_token_latency_seconds_count"] == before["vllm:inter_token_latency_seconds_count"] + 3
    for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total"):
        assert f"vllm:{g}" in after
    assert after["pagelm:num_free_kv_blocks"] == after["pagelm:num_kv_blocks"] == 512


# ---- many clients, and clients that leave -----------------------------------------------------


def test_client_disconnect_mid_stream_frees_the_blocks(server):
    before = metrics(server)
    body = {"model": MODEL, "prompt": "forever", "max_tokens": 480, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server, headers=headers, timeout=30) as http:
        streams = [http.stream("POST", "/v1/completions", json=body) for _ in range(4)]
        responses = [s.__enter__() for s in streams]
        for r in responses:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
        assert metrics(server)["pagelm:num_free_kv_blocks"] < 512
        for s in streams:
            s.__exit__(None, None, None)  # hang up mid-stream
    abort = "vllm:request_success_total{finished_reason=abort}"
    assert wait_for(lambda: metrics(server).get(abort, 0) == before.get(abort, 0) + 4)
    assert wait_for(lambda: metrics(server)["pagelm:num_free_kv_blocks"] == 512)
    generated = metrics(server)["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < 4 * 480


def test_client_that_gives_up_on_a_non_streamed_request_aborts_it(server):
    before = metrics(server)
    body = {"model": MODEL, "prompt": "patience", "max_tokens": 480, "n": 2, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=0.2)
    abort = "vllm:request_success_total{finished_reason=abort}"
    assert wait_for(lambda: metrics(server).get(abort, 0) == before.get(abort, 0) + 2)  # each sample, as vLLM
    assert wait_for(lambda: metrics(server)["pagelm:num_free_kv_blocks"] == 512)


def test_200_concurrent_streams_all_complete(client, server):
    prompts = [f"request {i}:" for i in range(5)]
    expected = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        .choices[0].text
        for p in prompts
    ]
    aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)

    async def one(i):
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompts[i % 5], max_tokens=8, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main():
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), 120)
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert [t for t, _ in results] == [expected[i % 5] for i in range(200)]
    assert all(f == "length" for _, f in results)
    assert wait_for(lambda: metrics(server)["pagelm:num_free_kv_blocks"] == 512)


# ---- the command line -------------------------------------------------------------------------


def test_bench_serve_against_the_server_and_in_process(server, llama_dir, tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run(
        pagelm_cmd(
            "bench", "serve", "--base-url", server, "--api-key", API_KEY, "--concurrency", "1,4",
            "--num-prompts", "8", "--output-len", "4", "--in-process", str(llama_dir), "--num-kv-blocks", "512",
            "--max-model-len", "512", "--json", str(out),
        ),
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    assert {(x["target"], x["concurrency"]) for x in rows} == {
        ("server", 1), ("server", 4), ("in-process", 1), ("in-process", 4)
    }
    assert all(x["errors"] == 0 and x["output_tokens_per_s"] > 0 for x in rows)
    assert "server / in-process" in r.stdout


# ---- hostile input: authentication, size, templates, the event loop -----------------------


@pytest.mark.parametrize("method, path", [
    ("post", "/tokenize"), ("post", "/detokenize"), ("get", "/metrics"), ("get", "/docs"), ("get", "/v1/models"),
    ("get", "/version"),
])
def test_every_route_but_health_needs_the_api_key(server, method, path):
    r = getattr(httpx, method)(f"{server}{path}", **({"json": {"prompt": "x"}} if method == "post" else {}))
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/health").status_code == 200


def test_a_request_chat_template_is_refused_unless_trusted(server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}
    r = httpx.post(f"{server}/v1/chat/completions", json=chat, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def open_server(llama_dir):
    """No API key, a small body limit, request chat templates trusted."""
    with running_server(
        str(llama_dir), "--served-model-name", MODEL, "--num-kv-blocks", "128", "--max-model-len", "512",
        "--max-request-body-bytes", "4096", "--trust-request-chat-template",
    ) as url:
        yield url


def test_a_body_over_the_limit_is_a_413_and_the_server_keeps_serving(open_server):
    big = {"model": MODEL, "prompt": "word " * 2000, "max_tokens": 2}
    r = httpx.post(f"{open_server}/v1/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "--max-request-body-bytes=4096" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(100):
            yield b"word " * 20
        yield b'", "max_tokens": 2}'

    r = httpx.post(f"{open_server}/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    ok = httpx.post(f"{open_server}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_trusted_request_chat_template_is_used(open_server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2,
            "chat_template": "{% for m in messages %}[{{ m.content }}]{% endfor %}"}
    r = httpx.post(f"{open_server}/v1/chat/completions", json=chat)
    assert r.status_code == 200
    tokens = httpx.post(f"{open_server}/tokenize", json={"prompt": "[hi there]", "add_special_tokens": False}).json()
    assert r.json()["usage"]["prompt_tokens"] == tokens["count"]


def test_tokenizing_a_long_prompt_does_not_stall_the_event_loop(server):
    """Tokenizing ran on the event loop: a 5 MB /tokenize held /health for 10.8 s."""
    import threading

    text = "hello world, this is a test. " * 60000  # 1.7 MB: about a second of tokenizing here
    done = {}

    def tokenize():
        t = time.perf_counter()
        r = httpx.post(f"{server}/tokenize", json={"prompt": text}, headers=AUTH, timeout=120)
        done["status"], done["seconds"] = r.status_code, time.perf_counter() - t

    worker = threading.Thread(target=tokenize)
    worker.start()
    time.sleep(0.3)
    t = time.perf_counter()
    health = httpx.get(f"{server}/health", timeout=30)
    health_s = time.perf_counter() - t
    worker.join()
    assert health.status_code == 200 and done["status"] == 200
    assert health_s < max(0.5 * done["seconds"], 0.25), (health_s, done["seconds"])


def test_a_streamed_chat_sends_its_first_chunk_with_the_first_token(client, server):
    """The role chunk went out before the request reached the engine: client-measured TTFT
    was ~5 ms whatever the request cost. Now no chunk comes before the engine's first token,
    so the client's time to the first chunk is at least the server's own TTFT (here mostly
    compiling a fresh JSON schema, ~0.1-0.3 s)."""
    import uuid

    tag = uuid.uuid4().hex[:8]  # a schema no earlier test compiled (compiled grammars are cached)
    props = {f"{tag}_{i}": {"type": "string", "pattern": "[a-z]{3,9}[0-9]{2,5}(x|y|z){1,4}"} for i in range(80)}
    schema = {"type": "object", "properties": props, "required": list(props)}
    before = metrics(server)
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    first_chunk_s = None
    for chunk in stream:
        if first_chunk_s is None:
            first_chunk_s = time.perf_counter() - start
            assert chunk.choices[0].delta.role == "assistant"
    after = metrics(server)
    name = "vllm:time_to_first_token_seconds_sum"
    server_ttft = after[name] - before[name]
    assert server_ttft > 0.05 and first_chunk_s >= server_ttft, (first_chunk_s, server_ttft)


def test_sigterm_drains_running_streams_then_ends_them_with_an_error_and_done(llama_dir):
    """SIGTERM waited a hard-coded 5 s, then cut streams with no error event or [DONE]."""
    import signal
    import threading

    proc, url = start_server(
        str(llama_dir), "--served-model-name", MODEL, "--max-model-len", "512", "--num-kv-blocks", "9000", "--max-n", "256",
        "--shutdown-timeout", "1",
    )
    try:
        events = {}

        # 256 samples of 480 tokens: several seconds of work for the tiny model, so that it is
        # still streaming when the 1 s drain ends (64 samples had finished by then on CI's CPU
        # machine).
        def stream(name, max_tokens):
            body = {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                    "n": 256}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                events[name] = [line for line in r.iter_lines() if line.startswith("data: ")]

        long = threading.Thread(target=stream, args=("long", 480))
        long.start()
        time.sleep(1.0)  # it is streaming
        proc.send_signal(signal.SIGTERM)
        long.join(30)
        # uvicorn re-raises the signal once it has shut down, so the exit is by SIGTERM.
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        tail = events["long"]
        assert tail[-1] == "data: [DONE]"
        error = json.loads(tail[-2].removeprefix("data: "))["error"]
        assert "shut down" in error["message"] and error["type"] == "service_unavailable"
        assert len(tail) > 10  # it streamed tokens first
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_retrieve_one_model_by_id(client, server):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found"
