"""The endpoints vLLM's clients and load balancers call besides the OpenAI API - `/ping`,
`/load`, `/tokenizer_info` - on a real `pagelm serve` on 127.0.0.1."""

import threading

import httpx
import pytest
from test_server import API_KEY, AUTH, MODEL, running_server, wait_for
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def server(llama_dir):
    with running_server(
        str(llama_dir), "--api-key", API_KEY, "--served-model-name", MODEL, "--num-kv-blocks", "512",
        "--max-model-len", "512", "--enable-tokenizer-info-endpoint",
    ) as url:
        yield url


def test_ping_answers_200_to_get_and_post_without_the_key(server):
    assert httpx.get(f"{server}/ping").status_code == 200
    assert httpx.post(f"{server}/ping").status_code == 200


@pytest.mark.parametrize("method, path", [("get", "/load"), ("get", "/tokenizer_info"), ("post", "/v1/responses")])
def test_the_new_routes_but_ping_need_the_api_key(server, method, path):
    r = getattr(httpx, method)(f"{server}{path}")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_load_counts_the_generation_requests_in_flight_streams_included(server):
    load = lambda: httpx.get(f"{server}/load", headers=AUTH).json()  # noqa: E731
    assert load() == {"server_load": 0}
    bodies = [
        ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 480, "ignore_eos": True, "stream": True}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "b"}], "max_tokens": 480,
                                  "ignore_eos": True, "stream": True}),
        ("/v1/responses", {"model": MODEL, "input": "c", "max_output_tokens": 480, "ignore_eos": True,
                           "stream": True}),
    ]
    with httpx.Client(base_url=server, headers=AUTH, timeout=30) as http:
        streams = [http.stream("POST", path, json=body) for path, body in bodies]
        # Held, not dropped: a dropped line iterator closes its connection (httpcore).
        lines = [s.__enter__().iter_lines() for s in streams]
        for it in lines:  # each has sent its first event: all three are running
            assert next(line for line in it if line.startswith("data: "))
        # A non-streamed one, held by the server while the streams run.
        held = threading.Thread(target=lambda: httpx.post(
            f"{server}/v1/completions", json={"model": MODEL, "prompt": "d", "max_tokens": 100, "ignore_eos": True},
            headers=AUTH, timeout=30,
        ))
        held.start()
        assert wait_for(lambda: load() == {"server_load": 4})
        held.join()
        assert load() == {"server_load": 3}
        for s in streams:
            s.__exit__(None, None, None)  # the client leaves: the stream ends
    assert wait_for(lambda: load() == {"server_load": 0})
    httpx.post(f"{server}/tokenize", json={"prompt": "not generation"}, headers=AUTH)
    assert load() == {"server_load": 0}


def test_tokenizer_info_is_the_tokenizer_configuration(server, llama_dir):
    info = httpx.get(f"{server}/tokenizer_info", headers=AUTH).json()
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == (
        tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token,
    )
    assert info["chat_template"] == tokenizer.chat_template
    assert info["added_tokens_decoder"] == {str(i): t.content for i, t in tokenizer.added_tokens_decoder.items()}
    assert info["model_max_length"] == tokenizer.model_max_length
    assert "vocab_file" not in info and "merges_file" not in info  # paths on the server
