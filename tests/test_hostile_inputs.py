"""Hostile input through a real `pagelm serve` on 127.0.0.1: every case is a 4xx in the OpenAI
error format (`{"error": {"message", "type", "param", "code"}}`) naming what was wrong, and the
next ordinary request is served. One table, one server; docs/security.md maps the vLLM
advisory classes to the cases here."""

import json
from dataclasses import dataclass, field

import httpx
import pytest

from test_server import running_server

MODEL = "tiny"
MAX_MODEL_LEN = 128
VOCAB = 512  # build_tiny_model's tokenizer
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(llama_dir):
    # A small body limit (8 MiB: a 5 MB prompt still gets in to be refused for its length) and
    # a short compile limit (the pathological schema below takes seconds to compile).
    with running_server(
        str(llama_dir), "--served-model-name", MODEL, "--num-kv-blocks", "64", "--max-model-len", str(MAX_MODEL_LEN),
        "--max-request-body-bytes", str(8 << 20), "--structured-output-compile-timeout", "0.5",
    ) as url:
        yield url


@dataclass
class Case:
    path: str = "/v1/completions"
    body: dict | None = None  # sent as JSON
    raw: bytes | None = None  # sent as it is, as application/json
    headers: dict = field(default_factory=dict)
    status: int = 400
    param: str | None = None  # the field the error must name (None: the body as a whole)
    words: str = ""  # and words the message must hold


def completion(status=400, **body):
    param = body.pop("_param")
    return Case(body={"model": MODEL, "prompt": "hi", "max_tokens": 2, **body}, status=status, param=param)


def chat(**body):
    param = body.pop("_param")
    return Case("/v1/chat/completions", body={"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **body}, param=param)


def raw(data: bytes, words: str, param=None, path="/v1/completions") -> Case:
    return Case(path, raw=data, param=param, words=words)


def nested(depth: int, inner: bytes = b"1") -> bytes:
    return b'{"a":' * depth + inner + b"}" * depth


def schema_nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# A JSON schema that takes seconds to compile (xgrammar time grows with the square of the
# required properties): it runs into --structured-output-compile-timeout.
SLOW_SCHEMA = {
    "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(6000)},
    "required": [f"p{i}" for i in range(6000)],
}
# A schema whose only definition is itself: it matches no text, so its grammar allows no token.
EMPTY_LANGUAGE_SCHEMA = {"$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#/definitions/a"}}}

CASES = {
    # ---- the body itself ---------------------------------------------------------------------
    "malformed-json": raw(b'{"prompt": "hi",', "not valid JSON"),
    "body-not-an-object": raw(b"[1, 2, 3]", "must be a JSON object"),
    "body-empty": raw(b"", "empty"),
    "body-not-utf8": raw(b'{"prompt": "\xff\xfe\xfa"}', "not valid UTF-8"),
    "json-nested-100000-deep": raw(b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    "json-integer-of-5000-digits": raw(b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", "not valid JSON"),
    "json-nan-temperature": raw(b'{"prompt": "hi", "temperature": NaN}', "temperature", "temperature"),
    "json-infinite-top-p": raw(b'{"prompt": "hi", "top_p": Infinity}', "top_p", "top_p"),
    "lone-surrogate-in-prompt": raw(b'{"prompt": "\\ud800"}', "surrogate", "prompt"),
    "lone-surrogate-in-cache-salt": raw(b'{"prompt": "hi", "cache_salt": "\\udfff"}', "surrogate", "cache_salt"),
    "lone-surrogate-in-a-message": raw(
        b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', "surrogate", "messages", "/v1/chat/completions"
    ),
    "lone-surrogate-in-a-field-name": raw(b'{"prompt": "hi", "\\ud800": 1}', "field name"),
    "header-of-1-mb": Case(body={"prompt": "hi"}, headers={"X-Big": "a" * (1 << 20)}, status=431, words="--max-header-bytes"),
    "300-headers": Case(body={"prompt": "hi"}, headers={f"X-H{i}": "1" for i in range(300)}, status=431, words="256 headers"),
    "body-of-9-mb": Case(body={"prompt": "a" * (9 << 20)}, status=413, words="--max-request-body-bytes"),
    "100000-unknown-fields": Case(body={"prompt": "hi", **{f"x{i}": 1 for i in range(100_000)}}, param="x0", words="more"),
    "unknown-field": completion(best_off=2, _param="best_off"),
    "unknown-model": Case(body={"model": "gpt-9", "prompt": "hi"}, status=404, param="model"),
    # ---- prompts -----------------------------------------------------------------------------
    "prompt-missing": Case(body={"model": MODEL}, param="prompt"),
    "prompt-a-number": completion(prompt=5, _param="prompt"),
    "prompt-null": completion(prompt=None, _param="prompt"),
    "prompt-empty-string": completion(prompt="", _param="prompt"),
    "prompt-empty-list": completion(prompt=[], _param="prompt"),
    "prompt-strings-and-ids-mixed": completion(prompt=["a", 5], _param="prompt"),
    "prompt-token-out-of-vocabulary": completion(prompt=[1, 10**6], _param="prompt"),
    "prompt-token-negative": completion(prompt=[-1], _param="prompt"),
    "prompt-token-beyond-int64": completion(prompt=[2**64], _param="prompt"),
    "prompt-batch-token-out-of-vocabulary": completion(prompt=[[1, 2], [VOCAB]], _param="prompt"),
    "prompt-of-5-mb": completion(prompt="a b " * 1_300_000, _param="prompt"),
    "prompt-of-1-million-token-ids": completion(prompt=[5] * 1_000_000, _param="prompt"),
    "prompt-over-max-model-len": completion(prompt="word " * 200, _param="prompt"),
    "prompt-ids-over-max-model-len": completion(prompt=list(range(5, 5 + MAX_MODEL_LEN)), _param="prompt"),
    "prompt-plus-max-tokens-over-max-model-len": completion(max_tokens=MAX_MODEL_LEN, _param="max_tokens"),
    "chat-message-of-5-mb": chat(messages=[{"role": "user", "content": "a b " * 1_300_000}], _param="messages"),
    "prompt-embeds": completion(prompt_embeds="AAAA", _param="prompt_embeds"),
    # ---- sampling fields ---------------------------------------------------------------------
    "n-zero": completion(n=0, _param="n"),
    "n-one-million": completion(n=10**6, _param="n"),
    "n-beyond-int64": completion(n=2**63, _param="n"),
    "n-a-string": completion(n="2", _param="n"),
    "prompts-20000": completion(prompt=[[5]] * 20000, _param="prompt"),
    "prompts-times-n-beyond-the-limit": completion(prompt=[[5]] * 16, n=100, _param="prompt"),
    "best_of-one-billion": completion(best_of=10**9, _param="best_of"),
    "best_of-negative": completion(best_of=-1, _param="best_of"),
    "logprobs-one-billion": completion(logprobs=10**9, _param="logprobs"),
    "logprobs-negative": completion(logprobs=-1, _param="logprobs"),
    "top_logprobs-one-million": chat(logprobs=True, top_logprobs=10**6, _param="top_logprobs"),
    "top_logprobs-without-logprobs": chat(top_logprobs=2, _param="top_logprobs"),
    "chat-logprobs-a-number": chat(logprobs=5, _param="logprobs"),
    "max_tokens-one-trillion": completion(max_tokens=10**12, _param="max_tokens"),
    "max_tokens-negative": completion(max_tokens=-5, _param="max_tokens"),
    "max_tokens-beyond-int64": completion(max_tokens=2**64, _param="max_tokens"),
    "max_completion_tokens-one-billion": chat(max_completion_tokens=10**9, _param="max_completion_tokens"),
    "temperature-negative": completion(temperature=-0.5, _param="temperature"),
    "temperature-1e300": completion(temperature=1e300, _param="temperature"),
    "temperature-a-string": completion(temperature="hot", _param="temperature"),
    "top_p-zero": completion(top_p=0, _param="top_p"),
    "top_k-minus-two": completion(top_k=-2, _param="top_k"),
    "top_k-a-float": completion(top_k=1.5, _param="top_k"),
    "min_p-above-one": completion(min_p=1.5, _param="min_p"),
    "presence_penalty-out-of-range": completion(presence_penalty=-3, _param="presence_penalty"),
    "frequency_penalty-out-of-range": completion(frequency_penalty=100, _param="frequency_penalty"),
    "repetition_penalty-zero": completion(repetition_penalty=0, _param="repetition_penalty"),
    "seed-beyond-int64": completion(seed=2**63, _param="seed"),
    "seed-a-string": completion(seed="1", _param="seed"),
    "min_tokens-above-max_tokens": completion(min_tokens=10, _param="min_tokens"),
    "priority-beyond-int64": completion(priority=-(2**63) - 1, _param="priority"),
    "10000-stop-strings": completion(stop=[f"s{i}" for i in range(10_000)], _param="stop"),
    "stop-empty-string": completion(stop=[""], _param="stop"),
    "stop-a-number": completion(stop=5, _param="stop"),
    "stop_token_ids-out-of-vocabulary": completion(stop_token_ids=[VOCAB], _param="stop_token_ids"),
    "stop_token_ids-negative": completion(stop_token_ids=[-1], _param="stop_token_ids"),
    "min_tokens-negative": completion(min_tokens=-1, _param="min_tokens"),
    "ignore_eos-a-string": completion(ignore_eos="true", _param="ignore_eos"),
    "skip_special_tokens-a-number": completion(skip_special_tokens=0, _param="skip_special_tokens"),
    "include_stop_str_in_output-a-string": completion(include_stop_str_in_output="no", _param="include_stop_str_in_output"),
    "user-a-number": completion(user=5, _param="user"),
    "suffix": completion(suffix="def", _param="suffix"),
    "stream-a-string": completion(stream="yes", _param="stream"),
    "stream_options-without-stream": completion(stream_options={"include_usage": True}, _param="stream_options"),
    "echo-a-number": completion(echo=1, _param="echo"),
    "cache_salt-empty": completion(cache_salt="", _param="cache_salt"),
    "cache_salt-a-number": completion(cache_salt=5, _param="cache_salt"),
    "extra_args-a-list": completion(extra_args=[1], _param="extra_args"),
    "extra_args-nested-200-deep": raw(b'{"prompt": "hi", "extra_args": ' + nested(200) + b"}", "levels deep", "extra_args"),
    "logit_bias-key-not-a-token-id": completion(logit_bias={"abc": 1}, _param="logit_bias"),
    "logit_bias-value-beyond-100": completion(logit_bias={"5": 1000}, _param="logit_bias"),
    "logit_bias-more-entries-than-the-vocabulary": completion(
        logit_bias={str(i): 1 for i in range(VOCAB + 100)}, _param="logit_bias"
    ),
    # ---- output constraints ------------------------------------------------------------------
    "guided_json-invalid-schema": completion(guided_json={"type": "nonsense"}, _param="guided_json"),
    "guided_json-not-json": completion(guided_json="{not json", _param="guided_json"),
    "guided_json-dangling-ref": completion(guided_json={"$ref": "#/nope"}, _param="guided_json"),
    "guided_json-bad-pattern": completion(guided_json={"type": "string", "pattern": "(("}, _param="guided_json"),
    "guided_json-nested-300-deep": completion(guided_json=schema_nested(300), _param="guided_json"),
    "guided_json-matching-no-text": completion(guided_json=EMPTY_LANGUAGE_SCHEMA, _param="guided_json"),
    "guided_json-too-slow-to-compile": completion(guided_json=SLOW_SCHEMA, _param="guided_json"),
    "guided_regex-unclosed-group": completion(guided_regex="((", _param="guided_regex"),
    "guided_regex-backreference": completion(guided_regex=r"(a)\1", _param="guided_regex"),
    "guided_regex-empty": completion(guided_regex="", _param="guided_regex"),
    "guided_regex-nested-5000-deep": completion(guided_regex="(" * 5000 + "a" + ")" * 5000, _param="guided_regex"),
    "guided_grammar-invalid": completion(guided_grammar="root ::= ", _param="guided_grammar"),
    "guided_choice-empty": completion(guided_choice=[], _param="guided_choice"),
    "two-output-constraints": completion(guided_choice=["a"], guided_regex="a", _param="guided_choice"),
    "response_format-unknown-type": chat(response_format={"type": "xml"}, _param="response_format"),
    "response_format-json_schema-without-schema": chat(response_format={"type": "json_schema"}, _param="response_format"),
    "response_format-a-string": chat(response_format="json", _param="response_format"),
    "response_format-schema-invalid": chat(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}, _param="response_format"
    ),
    # ---- chat: templates and messages --------------------------------------------------------
    "chat_template-from-the-request": chat(chat_template="{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}{% endfor %}", _param="chat_template"),
    "chat_template_kwargs-overriding-the-template": chat(
        chat_template_kwargs={"chat_template": "{{ 'x' * 99999999 }}"}, _param="chat_template_kwargs"
    ),
    "chat_template_kwargs-tokenize": chat(chat_template_kwargs={"tokenize": True}, _param="chat_template_kwargs"),
    "chat_template_kwargs-a-number": chat(chat_template_kwargs=5, _param="chat_template_kwargs"),
    "messages-empty": chat(messages=[], _param="messages"),
    "messages-missing": Case("/v1/chat/completions", body={"model": MODEL}, param="messages"),
    "messages-a-string": chat(messages="hi", _param="messages"),
    "message-null": chat(messages=[None], _param="messages"),
    "message-without-role": chat(messages=[{"content": "hi"}], _param="messages"),
    "message-name-a-number": chat(messages=[{"role": "user", "content": "hi", "name": 5}], _param="messages"),
    "add_generation_prompt-a-string": chat(add_generation_prompt="yes", _param="add_generation_prompt"),
    "message-role-a-number": chat(messages=[{"role": 5, "content": "hi"}], _param="messages"),
    "message-content-a-number": chat(messages=[{"role": "user", "content": 5}], _param="messages"),
    "message-content-part-an-image": chat(
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}],
        _param="messages",
    ),
    "message-content-part-text-a-number": chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}], _param="messages"
    ),
    "message-content-part-not-an-object": chat(messages=[{"role": "user", "content": ["hi"]}], _param="messages"),
    "tools": chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}],
                  tool_choice="none", _param="tools[0].function.parameters"),
    # ---- the tokenizer endpoints -------------------------------------------------------------
    "detokenize-out-of-vocabulary": Case("/detokenize", body={"tokens": [VOCAB, 10**9]}, param="tokens"),
    "detokenize-beyond-int64": Case("/detokenize", body={"tokens": [2**64]}, param="tokens"),
    "tokenize-neither-prompt-nor-messages": Case("/tokenize", body={}, param="prompt"),
    "tokenize-with-a-chat_template": Case("/tokenize", body={"messages": MESSAGES, "chat_template": "{{ 1 }}"},
                                          param="chat_template"),
    "tokenize-with-reserved-chat_template_kwargs": Case(
        "/tokenize", body={"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}, param="chat_template_kwargs"
    ),
    "tokenize-tools-not-a-list": Case("/tokenize", body={"messages": MESSAGES, "tools": {"type": "function"}},
                                      param="tools"),
    "tokenize-lone-surrogate": raw(b'{"prompt": "a\\udc00"}', "surrogate", "prompt", "/tokenize"),
}


def send(server: str, case: Case) -> httpx.Response:
    headers = dict(case.headers)
    if case.raw is not None:
        return httpx.post(f"{server}{case.path}", content=case.raw, headers={"Content-Type": "application/json", **headers},
                          timeout=120)
    return httpx.post(f"{server}{case.path}", json=case.body, headers=headers, timeout=120)


def test_the_table_is_large_enough():
    assert len(CASES) >= 60


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_input_is_a_4xx_naming_the_problem_and_the_server_serves_on(server, name):
    case = CASES[name]
    r = send(server, case)
    assert r.status_code == case.status, r.text[:500]
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert error["type"] == "invalid_request_error" and isinstance(error["message"], str) and error["message"]
    assert len(r.content) < 4096, "an error names the problem; it does not echo the request"
    if case.param is None:
        assert error["param"] is None
    else:
        # "messages.0.content" names messages too
        assert error["param"] == case.param or error["param"].startswith(case.param + "."), error
    assert case.words in error["message"], error["message"]

    ok = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 3,
                                                      "ignore_eos": True}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200


def test_a_stream_with_a_grammar_that_matches_nothing_fails_naming_the_field(server):
    """The grammar fails only once it runs (its first sampled token is refused). A streamed
    chat answers that with a 400 when it is known with the first output (the grammar was
    compiled already), else with a stream that ends in an error event, then [DONE]; either
    way naming the field."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "stream": True, "guided_json": EMPTY_LANGUAGE_SCHEMA}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    if r.status_code == 400:
        error = r.json()["error"]
    else:
        events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]", r.text[:500]
        error = json.loads(events[-2])["error"]
    assert error["param"] == "guided_json" and "allows no token" in error["message"]
    assert error["type"] == "invalid_request_error"


def test_fields_pagelm_may_refuse_are_accepted_when_valid(server):
    """The oracle for the table: the same server serves the well-formed neighbours of the
    cases above (a role it does not know, a NUL in the prompt, 128 stop strings, text parts)."""
    bodies = [
        ("/v1/completions", {"prompt": "a\u0000b", "max_tokens": 2, "stop": [f"s{i}" for i in range(128)]}),
        ("/v1/completions", {"prompt": [[5, 6], [7]], "max_tokens": 2, "cache_salt": "tenant-a", "seed": 2**63 - 1}),
        ("/v1/completions", {"prompt": "caf\u00e9 \U0001f600", "max_tokens": 2, "extra_args": nested_args(100)}),
        ("/v1/chat/completions", {"messages": [{"role": "narrator", "content": [{"type": "text", "text": "hi"}]}],
                                  "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "guided_json": schema_nested(20)}),
    ]
    for path, body in bodies:
        r = httpx.post(f"{server}{path}", json={"model": MODEL, **body}, timeout=60)
        assert r.status_code == 200, (body, r.text[:300])


def test_a_schema_with_an_integer_past_64_bits_is_served(server):
    """Valid JSON, so a valid schema: it crossed to the engine core as msgpack, which has no
    such integers (a 500); it goes as JSON text now."""
    big = 10**30
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 100, "guided_json": {"enum": [big, "x"]}}
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text[:300]
    choice = r.json()["choices"][0]
    value = json.loads(choice["text"])  # xgrammar writes the number as a double: 1e+30
    assert choice["finish_reason"] == "stop" and (value == "x" or float(value) == float(big)), choice


def nested_args(depth: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(depth - 2):  # the body and extra_args itself are two levels
        value = {"a": value}
    return value


def test_error_bodies_are_json_even_when_they_quote_invalid_text(server):
    r = httpx.post(f"{server}/v1/completions", content=b'{"prompt": "hi", "bad\\ud800name": 1}',
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and json.loads(r.content)["error"]["param"] is None


def test_request_heads_are_counted_per_request_on_a_kept_alive_connection(server):
    """The head limit (64 KiB) holds per request: three 40 KB heads in a row on one
    connection, each followed by a 300 KB body, are all served."""
    with httpx.Client(base_url=server, timeout=60) as client:
        for i in range(3):
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": "u" * (300 << 10)}
            r = client.post("/v1/completions", json=body, headers={"X-Trace": str(i) * (40 << 10)})
            assert r.status_code == 200, r.text[:300]
        assert r.headers.get("connection", "keep-alive") != "close"
