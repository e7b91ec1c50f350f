"""Guided decoding through the OpenAI-compatible server: `response_format` and vLLM's
`guided_*` extra body fields, with the official `openai` client on 127.0.0.1; bad constraints
are 400s naming the parameter."""

import json
import re

import jsonschema
import openai
import pytest
from test_server import running_server

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["id", "ok"],
}
MESSAGES = [{"role": "user", "content": "Give me a record."}]


@pytest.fixture(scope="module")
def server(llama_dir):
    with running_server(
        str(llama_dir), "--served-model-name", "tiny", "--num-kv-blocks", "256", "--max-model-len", "512",
        # The random model would write whitespace between JSON tokens for a long time.
        "--plugin-config", '{"xgrammar": {"any_whitespace": false}}',
        # As on CUDA (the default there): a grammar process, started by the first guided
        # request under the engine core's process, fills the rows once it is ready.
        "--structured-output-process",
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def test_chat_response_format_json_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=fmt, n=4, max_tokens=64)
    for choice in resp.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.finish_reason == "stop"


def test_streamed_json_schema_deltas_add_up_to_a_valid_document(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format=fmt, max_tokens=64, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_chat_response_format_json_object_starts_an_object(client):
    resp = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format={"type": "json_object"}, max_tokens=8
    )
    assert resp.choices[0].message.content.startswith("{")


def test_completion_guided_json_choice_and_regex(client):
    kw = dict(model="tiny", prompt="Answer:", max_tokens=32, n=3)
    out = client.completions.create(**kw, extra_body={"guided_json": json.dumps(SCHEMA)})
    assert all(jsonschema.validate(json.loads(c.text), SCHEMA) is None for c in out.choices)
    out = client.completions.create(**kw, extra_body={"guided_choice": ["left", "right"]})
    assert {c.text for c in out.choices} <= {"left", "right"}
    out = client.completions.create(**kw, extra_body={"guided_regex": r"[A-Z][a-z]{1,4} [0-9]{2}"})
    assert all(re.fullmatch(r"[A-Z][a-z]{1,4} [0-9]{2}", c.text) for c in out.choices)


def test_chat_guided_grammar(client):
    grammar = 'root ::= ("ab" | "cd") ("!" | "?")'
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, n=3, extra_body={"guided_grammar": grammar})
    assert all(re.fullmatch(r"(ab|cd)[!?]", c.message.content) for c in resp.choices)


@pytest.mark.parametrize("kwargs, param, words", [
    (dict(extra_body={"guided_json": {"type": "objekt"}}), "guided_json", "guided_json: invalid JSON schema"),
    (dict(extra_body={"guided_json": "{not json"}), "guided_json", "guided_json is not valid JSON"),
    (dict(extra_body={"guided_regex": "(ab"}), "guided_regex", "guided_regex: invalid regex"),
    (dict(extra_body={"guided_grammar": "root ::= nope"}), "guided_grammar", "invalid EBNF grammar"),
    (dict(extra_body={"guided_choice": []}), "guided_choice", "non-empty list"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}),
     "response_format", "response_format.json_schema.schema: invalid JSON schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format", "needs json_schema.schema"),
    (dict(response_format={"type": "yaml"}), "response_format", "text, json_object or json_schema"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}), "guided_regex", "at most one"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraint_is_a_400_naming_the_parameter(client, kwargs, param, words, stream):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, stream=stream, **kwargs)
    error = info.value.body
    assert info.value.status_code == 400 and error["param"] == param
    assert words in error["message"], error["message"]


def test_server_keeps_serving_after_bad_constraints(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"guided_regex": "(("})
    out = client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"guided_choice": ["only"]})
    assert out.choices[0].text == "only"
