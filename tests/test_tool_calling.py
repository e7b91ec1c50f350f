"""Tool calling through the OpenAI-compatible server, as clients meet it: a real `pagelm serve`
on 127.0.0.1 with the official `openai` client (and LangChain's `ChatOpenAI.bind_tools`).

A random-weight model never decides to call a tool, so ``tool_choice="auto"`` is checked
end to end only for passing text through unchanged (the parsers' reading of real tool-call
outputs is tests/test_tool_parsers.py); ``required`` and named choices run under guided
decoding, so their calls are checked here: they parse, name the right function, and their
arguments validate against the tool's JSON schema, streamed and not."""

import json

import httpx
import jsonschema
import openai
import pytest
from test_server import pagelm_cmd, running_server
from transformers import AutoTokenizer

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
ADD_PARAMS = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"],
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER_PARAMS}}
ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD_PARAMS}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "add": ADD_PARAMS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
COMMON = ("--served-model-name", "tiny", "--num-kv-blocks", "512", "--max-model-len", "2048",
          # The random model would write whitespace between JSON tokens for a long time.
          "--plugin-config", '{"xgrammar": {"any_whitespace": false}}')


@pytest.fixture(scope="module")
def model_dir(make_model):
    # Room for the tools in the prompt (the rendered tool list is long for a 512-token vocabulary).
    return make_model("tools-llama", "llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def client(model_dir):
    with running_server(str(model_dir), *COMMON, "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def check_calls(calls, names=tuple(SCHEMAS)):
    """Each call has an id, names one of ``names`` and has arguments valid for its schema."""
    assert calls, "no tool calls"
    for call in calls:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(stream):
    """(content, [(id, name, arguments)], finish_reasons) put together from a chat stream."""
    content, calls, finish = "", {}, []
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                if piece.index not in calls:
                    assert piece.id and piece.function.name, "a call's first delta carries its id and name"
                    calls[piece.index] = [piece.id, piece.function.name, ""]
                calls[piece.index][2] += piece.function.arguments or ""
            if choice.finish_reason is not None:
                finish.append(choice.finish_reason)
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in range(len(calls))], finish


# ---- named and required: guided by the tools' schemas -------------------------------------


def test_named_tool_choice_calls_that_function_with_valid_arguments(client):
    resp = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, n=3, max_tokens=64, seed=0
    )
    for choice in resp.choices:
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, names=["get_weather"])
        assert choice.finish_reason == "stop"  # as OpenAI answers a named choice


def test_named_tool_choice_streams_the_same_call_piece_by_piece(client):
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
              max_tokens=64, seed=7)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    content, calls, finish = streamed(client.chat.completions.create(**kw, stream=True))
    assert content == "" and finish == ["stop"]
    ((_, name, arguments),) = calls
    assert (name, arguments) == ("add", whole.function.arguments)
    jsonschema.validate(json.loads(arguments), ADD_PARAMS)


def test_required_calls_name_offered_tools_with_valid_arguments(client):
    resp = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", n=4, max_tokens=1200, seed=1
    )
    for choice in resp.choices:
        assert choice.message.content is None and choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls)
        assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


def test_required_without_parallel_calls_makes_exactly_one(client):
    resp = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        n=4, max_tokens=200, seed=2,
    )
    for choice in resp.choices:
        assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls)


def test_required_streams_the_calls_of_the_whole_response(client):
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=1200, seed=3)
    whole = client.chat.completions.create(**kw).choices[0]
    content, calls, finish = streamed(client.chat.completions.create(**kw, stream=True))
    assert content == "" and finish == ["tool_calls"]
    assert [(n, a) for _, n, a in calls] == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    for _, name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# ---- auto and none: free text --------------------------------------------------------------


def test_auto_passes_text_without_calls_through_unchanged(client):
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=24, temperature=0.0)
    plain = client.chat.completions.create(**kw, tool_choice="none").choices[0]
    auto = client.chat.completions.create(**kw).choices[0]  # tools without tool_choice: auto
    assert auto.message.content == plain.message.content and auto.message.content
    assert auto.message.tool_calls is None and plain.message.tool_calls is None
    assert auto.finish_reason == plain.finish_reason == "length"
    content, calls, finish = streamed(client.chat.completions.create(**kw, tool_choice="auto", stream=True))
    assert (content, calls, finish) == (plain.message.content, [], ["length"])


def test_tools_and_tool_turns_reach_the_chat_template(client, model_dir):
    """The prompt the server renders (its token count) is the chat template's rendering of
    the tools, an assistant turn's calls (arguments as objects) and the tool's answer."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rendered = tokenizer.apply_chat_template(
        [*MESSAGES, {**history[1], "content": "", "tool_calls": [
            {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, history[2]],
        tools=TOOLS, tokenize=False, add_generation_prompt=True,
    )
    assert '<tool_response id="call_1">' in rendered and '"name": "add"' in rendered
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in rendered
    resp = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert resp.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    without_tools = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    assert without_tools.usage.prompt_tokens < resp.usage.prompt_tokens


def test_tokenize_with_tools_counts_the_prompt_chat_renders(client, model_dir):
    """vLLM's /tokenize takes tools: the ids are the chat template's rendering with them, the
    very prompt /v1/chat/completions runs (its prompt_tokens)."""
    url = str(client.base_url).removesuffix("/v1/")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rendered = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"name": "get_weather"' in rendered
    r = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES, "tools": TOOLS, "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"]) and body["count"] == len(body["tokens"])
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert chat.usage.prompt_tokens == body["count"]
    plain = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()
    assert plain["count"] < body["count"] and plain["token_strs"] is None


@pytest.mark.parametrize("body, param, words", [
    ({"messages": MESSAGES, "tools": [WEATHER, WEATHER]}, "tools[1].function.name", "is also tools[0]'s"),
    ({"messages": MESSAGES, "tools": [{"type": "retrieval"}]}, "tools[0].type", 'must be "function"'),
    ({"prompt": "hi", "tools": TOOLS}, "tools", "applies to messages, not to a prompt"),
    ({"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True}, "continue_final_message",
     "cannot both be true"),
])
def test_tokenize_checks_tools_as_chat_does(client, body, param, words):
    r = httpx.post(f"{str(client.base_url).removesuffix('/v1/')}/tokenize", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_tiny_chat_template_renders_turns_without_tools_as_plain_chatml(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    turns = [{"role": "system", "content": "Be brief."}, *MESSAGES, {"role": "assistant", "content": "Sunny."}]
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert text == "".join(f"<|im_start|>{t['role']}\n{t['content']}<|im_end|>\n" for t in turns) + "<|im_start|>assistant\n"


# ---- bad input: 400s naming the parameter ----------------------------------------------------


def _tool(**function):
    return {"type": "function", "function": {"name": "f", **function}}


@pytest.mark.parametrize("kwargs, param, words", [
    (dict(tools={"type": "function"}), "tools", "list"),
    (dict(tools=[{"type": "retrieval"}]), "tools[0].type", 'must be "function"'),
    (dict(tools=[{"type": "function"}]), "tools[0].function", "must be an object with a name"),
    (dict(tools=[_tool(name="get weather")]), "tools[0].function.name", "1 to 64 of a-z"),
    (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name", "is also tools[0]'s"),
    (dict(tools=[_tool(parameters={"type": "array"})]), "tools[0].function.parameters", "JSON schema of an object"),
    (dict(tools=[_tool(parameters="{}")]), "tools[0].function.parameters", "JSON schema of an object"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
     "'nope', which is not in tools (given: get_weather, add)"),
    (dict(tools=TOOLS, tool_choice={"type": "function"}), "tool_choice", "a named tool_choice is"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice", '"none", "auto", "required" or a named function'),
    (dict(tool_choice="required"), "tool_choice", "tool_choice needs tools"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format",
     "constrains the output to tool calls already"),
    (dict(tools=[_tool(parameters={"type": "object", "properties": {"a": {"type": "objekt"}}})],
          tool_choice={"type": "function", "function": {"name": "f"}}),
     "tools[0].function.parameters", "tools[0].function.parameters: invalid JSON schema"),
    (dict(tools=TOOLS, tool_choice="none", messages=[*MESSAGES, {"role": "assistant", "tool_calls": [{"id": "x"}]}]),
     "messages[1].tool_calls", "needs function.name"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_tools_are_a_400_naming_the_parameter(client, kwargs, param, words, stream):
    kwargs = {"messages": MESSAGES, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", max_tokens=8, stream=stream, **kwargs)
    error = info.value.body
    assert info.value.status_code == 400 and error["param"] == param, error
    assert words in error["message"], error["message"]
    # ... and the server serves on
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=64)
    check_calls(resp.choices[0].message.tool_calls)


def test_auto_needs_the_servers_auto_tool_choice_flag(model_dir):
    with running_server(str(model_dir), *COMMON) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        for choice in ({}, {"tool_choice": "auto"}):  # tools alone mean auto
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=4, **choice)
            assert info.value.body["param"] == "tool_choice"
            assert "requires --enable-auto-tool-choice and --tool-call-parser" in info.value.body["message"]
        # the forced choices and none need no parser
        resp = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=64)
        check_calls(resp.choices[0].message.tool_calls, names=["get_weather"])
        resp = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=4)
        assert resp.choices[0].message.content and resp.choices[0].message.tool_calls is None


def test_exclude_tools_when_tool_choice_none_renders_none_for_none(model_dir):
    """vLLM's --exclude-tools-when-tool-choice-none: tool_choice "none" runs the prompt without
    the tools (the same prompt as no tools); another tool_choice still renders them."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def count(**kw):
        return len(tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kw),
                                    add_special_tokens=False))

    with running_server(str(model_dir), *COMMON, "--exclude-tools-when-tool-choice-none") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=1)
        none = client.chat.completions.create(**kw, tool_choice="none")
        assert none.usage.prompt_tokens == count() < count(tools=TOOLS)
        named = client.chat.completions.create(**{**kw, "max_tokens": 64}, tool_choice=NAMED)
        assert named.usage.prompt_tokens == count(tools=TOOLS)
        check_calls(named.choices[0].message.tool_calls, names=["get_weather"])
        with pytest.raises(openai.BadRequestError) as info:  # excluded from the prompt, still checked
            client.chat.completions.create(**{**kw, "tools": [WEATHER, WEATHER]}, tool_choice="none")
        assert info.value.body["param"] == "tools[1].function.name"


@pytest.mark.parametrize("flags, words", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser NAME"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "nope"], "unknown tool call parser 'nope'; registered: hermes, llama3_json"),
])
def test_serve_refuses_tool_flags_it_cannot_honour_before_starting(model_dir, flags, words):
    import subprocess

    proc = subprocess.run(pagelm_cmd("serve", str(model_dir), *flags), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and words in proc.stderr, proc.stderr


# ---- LangChain --------------------------------------------------------------------------------


def test_langchain_bind_tools_calls_the_tool(client):
    from langchain_openai import ChatOpenAI  # a test dependency (pyproject's test extra)

    chat = ChatOpenAI(
        model="tiny", base_url=str(client.base_url), api_key="none", max_tokens=200, seed=4, max_retries=0
    )
    for tool_choice in ("get_weather", "required"):
        message = chat.bind_tools(TOOLS, tool_choice=tool_choice).invoke("What is the weather in Paris?")
        assert message.tool_calls, message
        for call in message.tool_calls:  # LangChain parses the arguments itself
            assert call["name"] in (["get_weather"] if tool_choice == "get_weather" else SCHEMAS)
            jsonschema.validate(call["args"], SCHEMAS[call["name"]])
    chunks = list(chat.bind_tools(TOOLS, tool_choice="add").stream("What is 2 + 3?"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    ((call,),) = [merged.tool_calls]
    assert call["name"] == "add"
    jsonschema.validate(call["args"], ADD_PARAMS)
