"""A streamed request answers only once the engine has its first output, so that what goes
wrong before then is an HTTP error (500, 503) the client can act on, not a 200 followed by an
error event. Tested on a real server on 127.0.0.1 whose engine core runs in a thread of this
process, so that a test can make the next engine step fail or begin a drain."""

import contextlib
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from test_server import MODEL, free_port, metrics

from pagelm.engine.async_llm import AsyncLLM
from pagelm.plugins.server.app import build_app

STREAMS = {
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                             "stream": True},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 4, "stream": True},
}


@pytest.fixture(scope="module")
def inproc(llama_dir):
    """(base URL, engine) of a server (no API key, no /tokenizer_info) on a free port."""
    engine = AsyncLLM.from_model(str(llama_dir), engine_process=False, num_kv_blocks=128, max_model_len=256)
    server = uvicorn.Server(uvicorn.Config(
        build_app(engine, model_name=MODEL), host="127.0.0.1", port=free_port(), log_level="warning",
    ))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.config.port}"
    deadline = time.time() + 60
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "server did not come up"
        time.sleep(0.05)
    yield url, engine
    server.should_exit = True
    thread.join(30)


@contextlib.contextmanager
def next_step(engine: AsyncLLM, before):
    """Call ``before()`` as the engine core's next step starts (once): a step that raises,
    as a device fault would, or one that takes its time."""
    runner = engine.core.core.runner
    launch = runner.launch

    def launch_once(sched, **kwargs):
        runner.launch = launch
        before()
        return launch(sched, **kwargs)

    runner.launch = launch_once
    try:
        yield
    finally:
        runner.launch = launch


def fault() -> None:
    raise RuntimeError("injected fault")


@pytest.mark.parametrize("path", list(STREAMS))
def test_a_step_that_fails_before_the_first_token_is_a_500(inproc, path):
    url, engine = inproc
    with next_step(engine, fault), httpx.stream("POST", f"{url}{path}", json=STREAMS[path], timeout=30) as r:
        body = r.read()
    assert r.status_code == 500, body
    error = r.json()["error"]
    assert "injected fault" in error["message"] and error["type"] == "internal_error"
    again = httpx.post(f"{url}{path}", json=STREAMS[path], timeout=30)  # the engine serves on
    assert again.status_code == 200 and ("[DONE]" in again.text or "response.completed" in again.text)


@pytest.mark.parametrize("path", list(STREAMS))
def test_a_stream_asked_for_while_draining_is_a_503(inproc, path):
    url, engine = inproc
    engine.begin_drain()
    try:
        r = httpx.post(f"{url}{path}", json=STREAMS[path], timeout=30)
    finally:
        engine.draining = False
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


def test_the_openai_client_sees_the_error_when_it_starts_a_stream(inproc):
    url, engine = inproc
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with next_step(engine, fault), pytest.raises(openai.InternalServerError, match="injected fault"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True)
    with next_step(engine, fault), pytest.raises(openai.InternalServerError, match="injected fault"):
        client.responses.create(model=MODEL, input="hi", max_output_tokens=4, stream=True)


def test_tokenizer_info_is_off_unless_enabled(inproc):
    url, _ = inproc
    r = httpx.get(f"{url}/tokenizer_info")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"
    assert httpx.get(f"{url}/ping").status_code == 200  # its neighbours are there


def test_a_streamed_completion_answers_with_the_engines_first_output(inproc):
    """The status line and headers went out before the request reached the engine: a client
    timing its stream's start read a few ms whatever the prefill cost. Now the stream starts
    with the engine's first output, so the time to its headers is at least the server's own
    TTFT (here at least the 0.3 s its first step is made to take)."""
    url, engine = inproc
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    before = metrics(url)
    with next_step(engine, lambda: time.sleep(0.3)):
        start = time.perf_counter()
        stream = client.completions.create(  # returns once the status line and headers are in
            model=MODEL, prompt="hi", max_tokens=2, stream=True,
        )
        headers_s = time.perf_counter() - start
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    after = metrics(url)
    name = "vllm:time_to_first_token_seconds_sum"
    server_ttft = after[name] - before[name]
    assert text and server_ttft >= 0.3 and headers_s >= server_ttft, (headers_s, server_ttft)
