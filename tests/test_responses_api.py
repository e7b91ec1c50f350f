"""`POST /v1/responses` (OpenAI's Responses API) on a real `pagelm serve` on 127.0.0.1, driven
by the official `openai` client: `client.responses.create`, its streamed events, the SDK's
stream helper and `responses.parse`. The chat endpoint of the same server is the oracle: a
Responses request is a chat request by another name."""

import json
from typing import Literal

import httpx
import openai
import pydantic
import pytest
from test_server import API_KEY, AUTH, MODEL, metrics, running_server, wait_for

GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(llama_dir):
    with running_server(
        str(llama_dir), "--api-key", API_KEY, "--served-model-name", MODEL, "--num-kv-blocks", "512",
        "--max-model-len", "512",
        # The random model would write whitespace between JSON tokens for a long time.
        "--plugin-config", '{"xgrammar": {"any_whitespace": false}}',
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


def chat_text(client, messages, max_tokens, **kw):
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, **GREEDY, **kw)
    return r.choices[0].message.content, r.usage.prompt_tokens


# ---- non-streamed -----------------------------------------------------------------------------


def test_a_string_input_is_one_user_message_answered_by_one_assistant_message(client):
    r = client.responses.create(model=MODEL, input="hello there", max_output_tokens=8, metadata={"k": "v"}, **GREEDY)
    text, prompt_tokens = chat_text(client, [{"role": "user", "content": "hello there"}], 8)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert [(o.type, o.role) for o in r.output] == [("message", "assistant")]
    assert [c.type for c in r.output[0].content] == ["output_text"]
    assert r.output_text == text
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (prompt_tokens, 8, prompt_tokens + 8)
    # max_output_tokens cut it: incomplete, as the OpenAI API says it.
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"
    assert r.max_output_tokens == 8 and r.temperature == 0 and r.metadata == {"k": "v"}


def test_message_items_and_instructions_render_through_the_chat_template(client, server):
    items = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "input_text", "text": "one "}, {"type": "input_text", "text": "two"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "three"}]},
        {"role": "user", "content": "four"},
    ]
    r = client.responses.create(model=MODEL, input=items, instructions="you are terse", max_output_tokens=6, **GREEDY)
    # instructions: a first system message; developer: system (what chat templates know).
    messages = [
        {"role": "system", "content": "you are terse"}, {"role": "system", "content": "be brief"},
        {"role": "user", "content": "one two"}, {"role": "assistant", "content": "three"},
        {"role": "user", "content": "four"},
    ]
    text, prompt_tokens = chat_text(client, messages, 6)
    tokenized = httpx.post(f"{server}/tokenize", json={"messages": messages}, headers=AUTH).json()
    assert r.usage.input_tokens == prompt_tokens == tokenized["count"]
    assert r.output_text == text and r.instructions == "you are terse"


def test_a_model_stop_is_completed(client):
    """Stopping at a stop string (as at EOS) completes the response, unlike the token limit."""
    free = client.responses.create(model=MODEL, input="stop here", max_output_tokens=12, **GREEDY).output_text
    assert len(free) >= 5
    stop = free[3:5]
    r = client.responses.create(model=MODEL, input="stop here", max_output_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True, "stop": [stop]})
    assert r.status == "completed" and r.incomplete_details is None and r.output[0].status == "completed"
    assert r.output_text == free[: free.index(stop)]


def test_top_p_and_temperature_reach_the_sampler(client):
    """top_p that keeps one token samples greedily whatever the temperature; the same seed
    repeats a sample."""
    greedy = client.responses.create(model=MODEL, input="sample", max_output_tokens=10, **GREEDY).output_text
    narrow = client.responses.create(model=MODEL, input="sample", max_output_tokens=10, temperature=1.5, top_p=1e-9,
                                     extra_body={"ignore_eos": True})
    assert narrow.output_text == greedy and narrow.top_p == 1e-9
    seeded = [
        client.responses.create(model=MODEL, input="sample", max_output_tokens=10, temperature=1.5,
                                extra_body={"ignore_eos": True, "seed": 7}).output_text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1] != greedy


# ---- streamed ---------------------------------------------------------------------------------

LIFECYCLE_HEAD = ["response.created", "response.in_progress", "response.output_item.added",
                  "response.content_part.added"]
LIFECYCLE_TAIL = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                  "response.completed"]


def test_stream_sends_the_event_sequence_and_the_non_streamed_text(client):
    full = client.responses.create(model=MODEL, input="stream me", max_output_tokens=12, **GREEDY)
    events = list(client.responses.create(model=MODEL, input="stream me", max_output_tokens=12, stream=True,
                                          **GREEDY))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types == LIFECYCLE_HEAD + ["response.output_text.delta"] * len(deltas) + LIFECYCLE_TAIL
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(d.delta for d in deltas)
    assert text == full.output_text and len(deltas) >= 2
    created, item, done = events[0].response, events[2].item, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == done.id
    assert {e.item_id for e in events[3:-2] if hasattr(e, "item_id")} == {item.id} == {done.output[0].id}
    assert events[-4].text == text and events[-2].item.content[0].text == text
    assert done.output_text == text and done.status == "incomplete"
    assert (done.usage.input_tokens, done.usage.output_tokens) == (full.usage.input_tokens, 12)


def test_the_sdk_stream_helper_reads_the_final_response(client):
    full = client.responses.create(model=MODEL, input="helper", max_output_tokens=9, **GREEDY)
    with client.responses.stream(model=MODEL, input="helper", max_output_tokens=9, **GREEDY) as stream:
        snapshots = [e.snapshot for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == snapshots[-1] == full.output_text
    assert final.usage.output_tokens == 9


def test_the_sdk_parse_helper_gets_json_that_follows_text_format(client):
    class Answer(pydantic.BaseModel):
        verdict: bool
        label: Literal["cat", "dog"]

    r = client.responses.parse(model=MODEL, input="judge", text_format=Answer, max_output_tokens=40, temperature=0)
    assert r.status == "completed"
    assert isinstance(r.output_parsed, Answer) and Answer.model_validate_json(r.output_text) == r.output_parsed
    assert r.text.format.type == "json_schema"


def test_a_client_that_leaves_a_stream_aborts_it(server):
    before = metrics(server)
    body = {"model": MODEL, "input": "forever", "max_output_tokens": 480, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/responses", json=body, headers=AUTH, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: ") and "output_text.delta" in line)
    abort = "vllm:request_success_total{finished_reason=abort}"
    assert wait_for(lambda: metrics(server).get(abort, 0) == before.get(abort, 0) + 1)
    assert wait_for(lambda: metrics(server)["pagelm:num_free_kv_blocks"] == 512)


# ---- what the server does not do, and bad values: 400s naming the parameter ---------------------


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "name": "f", "parameters": {"type": "object"}}]),
    ("previous_response_id", "resp_123"),
    ("conversation", "conv_123"),
    ("background", True),
    ("prompt", {"id": "pmpt_1"}),
    ("reasoning", {"effort": "high"}),
    ("include", ["message.output_text.logprobs"]),
    ("top_logprobs", 3),
    ("max_tool_calls", 2),
    ("tool_choice", "required"),
    ("truncation", "auto"),
])
def test_unsupported_responses_features_are_400_naming_them(client, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", max_output_tokens=2, extra_body={field: value})
    assert info.value.status_code == 400 and info.value.body["param"] == field


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=2.5), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(max_output_tokens=0), "max_output_tokens"),
    (dict(max_output_tokens=600), "max_output_tokens"),  # past --max-model-len 512
    (dict(input=[]), "input"),
    (dict(input=[{"role": "tool", "content": "x"}]), "input.0.role"),
    (dict(input=[{"type": "function_call_output", "call_id": "c", "output": "x"}]), "input.0.type"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]),
     "input.0.content.0"),
    (dict(input=[{"role": "user", "content": "a"}, {"role": "user", "content": 5}]), "input.1.content"),
    (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}}), "text.format"),
    (dict(text={"format": {"type": "json_schema", "name": "x"}}), "text.format.schema"),
    (dict(text={"format": {"type": "yaml"}}), "text.format.type"),
    (dict(extra_body={"max_output_tokenz": 5}), "max_output_tokenz"),
    (dict(extra_body={"max_output_tokens": "5"}), "max_output_tokens"),
])
def test_bad_values_are_400_naming_the_parameter_and_the_server_serves_on(client, kwargs, param):
    kwargs.setdefault("input", "x")
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, **kwargs)
    assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"
    assert client.responses.create(model=MODEL, input="ok", max_output_tokens=2, **GREEDY).usage.output_tokens == 2


def test_unknown_model_is_404_and_the_key_is_required(client, server):
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="no-such-model", input="x")
    assert info.value.body["code"] == "model_not_found"
    r = httpx.post(f"{server}/v1/responses", json={"model": MODEL, "input": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_fields_the_responses_api_defines_but_changes_nothing_here_are_accepted(client):
    r = client.responses.create(
        model=MODEL, input="x", max_output_tokens=3, store=False, user="u1", parallel_tool_calls=False,
        tool_choice="none", truncation="disabled", service_tier="auto", prompt_cache_key="k", **GREEDY,
    )
    assert r.usage.output_tokens == 3 and r.user == "u1" and r.parallel_tool_calls is False
    assert json.loads(r.model_dump_json())["tool_choice"] == "none"
