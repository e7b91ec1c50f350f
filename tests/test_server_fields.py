"""vLLM's extra request fields on the OpenAI-compatible server, sent as users send them: the
official `openai` client's ``extra_body`` against a real `pagelm serve` on 127.0.0.1.

Oracles: Hugging Face ``transformers`` (prompt logprobs, the rendered chat prompt), the
tokenizer, and the server's own plain runs (what a bias, a ban or a truncation changes)."""

import json
import re
import shutil

import httpx
import jsonschema
import openai
import pytest
import torch
from test_server import running_server
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = "tiny"
PROMPT = "def add(a, b):"
MESSAGES = [{"role": "user", "content": "hello"}]
# The tiny model's ChatML template, plus a variable for chat_template_kwargs to set.
TEMPLATE = (
    "{% if greeting is defined %}{{ greeting + '\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("templated") / "llama"
    shutil.copytree(llama_dir, out)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return out


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(
        str(model_dir), "--served-model-name", MODEL, "--num-kv-blocks", "256", "--max-model-len", "128",
        "--dtype", "float32", "--plugin-config", '{"xgrammar": {"any_whitespace": false}}',
        "--max-num-batched-tokens", "32",  # prompts past 32 tokens are prefilled in chunks
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_logprobs(model_dir):
    """Token ids -> HF's log-softmax of each position's logits, [len, vocab]."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].log_softmax(-1)

    return run


def ids_of(logprobs) -> list[int]:
    """Token ids of a completion from its logprobs under return_tokens_as_token_ids."""
    return [int(t.removeprefix("token_id:")) for t in logprobs.tokens]


def complete(client, **kw) -> openai.types.Completion:
    extra = kw.pop("extra_body", {})
    return client.completions.create(
        model=MODEL, prompt=kw.pop("prompt", PROMPT), temperature=kw.pop("temperature", 0), logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **extra}, **kw,
    )


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server}/v1/{path}", json={"model": MODEL, **body}, timeout=60)


@pytest.fixture(scope="module")
def plain(client) -> list[int]:
    return ids_of(complete(client, max_tokens=16).choices[0].logprobs)


# ---- logits processors ------------------------------------------------------------------------


def test_logit_bias_plus_100_picks_the_token_and_minus_100_forbids_it(client, plain):
    assert ids_of(complete(client, max_tokens=6, logit_bias={"7": 100}).choices[0].logprobs) == [7] * 6
    banned = ids_of(complete(client, max_tokens=16, logit_bias={str(plain[0]): -100}).choices[0].logprobs)
    assert plain[0] not in banned and banned != plain
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logit_bias={"9": 100},
        logprobs=True, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    assert [c.token for c in chat.choices[0].logprobs.content] == ["token_id:9"] * 4


def test_allowed_token_ids_are_the_only_ones_sampled(client):
    allowed = [10, 20, 30, 40, 50]
    r = complete(client, max_tokens=32, temperature=1.0, seed=7, extra_body={"allowed_token_ids": allowed})
    out = ids_of(r.choices[0].logprobs)
    assert set(out) <= set(allowed) and len(set(out)) > 1


def test_bad_words_are_never_generated_where_the_plain_run_has_them(client, tokenizer, plain):
    j, word, forms = next(
        (j, w, forms) for j in range(len(plain) - 1)
        if (w := tokenizer.decode(plain[j : j + 2])).strip().isprintable() and w.strip()
        and plain[j : j + 2] in (forms := [tokenizer.encode(p + w.lstrip(), add_special_tokens=False) for p in ("", " ")])
    )
    out = ids_of(complete(client, max_tokens=16, extra_body={"bad_words": [word]}).choices[0].logprobs)
    assert not any(out[i : i + 2] == f for f in forms for i in range(len(out) - 1))
    assert out[: j + 1] == plain[: j + 1] and out[j + 1] != plain[j + 1]


def test_repetition_penalty_above_2_is_accepted_as_in_vllm(client):
    out = ids_of(complete(client, max_tokens=20, extra_body={"repetition_penalty": 10.0}).choices[0].logprobs)
    assert len(set(out)) == len(out)


# ---- prompt logprobs, echo, token ids ---------------------------------------------------------


def test_prompt_logprobs_equal_transformers(client, tokenizer, hf_logprobs):
    ids = tokenizer.encode(PROMPT)
    ref = hf_logprobs(ids)
    r = complete(client, max_tokens=2, extra_body={"prompt_logprobs": 3})
    entries = r.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for i, entry in enumerate(entries[1:], start=1):
        chosen = entry[str(ids[i])]
        assert chosen["logprob"] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        assert chosen["rank"] == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
        top = ref[i - 1].topk(3)
        for rank, (lp, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert entry[str(t)]["logprob"] == pytest.approx(lp, abs=1e-4) and entry[str(t)]["rank"] in (rank, chosen["rank"])


def test_chat_prompt_logprobs_sit_on_the_response(client, tokenizer, hf_logprobs):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 0},
    )
    ids = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)
    entries, ref = r.model_extra["prompt_logprobs"], hf_logprobs(ids)
    assert [int(next(iter(e))) for e in entries[1:]] == ids[1:]
    assert [e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[1:])] == pytest.approx(
        [ref[i, t].item() for i, t in enumerate(ids[1:])], abs=1e-4
    )


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(client, server, tokenizer, hf_logprobs):
    ids = tokenizer.encode(PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == PROMPT and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert len(c.logprobs.tokens) == len(ids) and c.logprobs.token_logprobs[0] is None
    ref = hf_logprobs(ids)
    assert c.logprobs.token_logprobs[1:] == pytest.approx([ref[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-4)
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == PROMPT
    assert post(server, "completions", {"prompt": "x", "max_tokens": 0}).status_code == 400  # no echo: nothing to return


def test_streamed_echo_of_a_chunked_prompt_carries_every_prompt_logprob(client, hf_logprobs):
    """A 70-token prompt is prefilled in three chunks; echo still streams all of it, scored."""
    prompt = [(7 * i) % 500 + 5 for i in range(70)]
    ref = hf_logprobs(prompt)
    for max_tokens in (0, 2):
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=0,
                                                stream=True, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}))
        lps = [ch.choices[0].logprobs for ch in chunks if ch.choices]
        ids = [i for lp in lps for i in ids_of(lp)]
        values = [v for lp in lps for v in lp.token_logprobs]
        assert ids[:70] == prompt and len(ids) == 70 + max_tokens and values[0] is None
        assert values[1:70] == pytest.approx([ref[i - 1, prompt[i]].item() for i in range(1, 70)], abs=1e-4)


def test_return_tokens_as_token_ids_gives_the_ids_of_the_text(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    c = r.choices[0]
    assert all(re.fullmatch(r"token_id:\d+", t) for t in c.logprobs.tokens)
    # (The text holds back a character whose bytes are not all generated yet.)
    assert tokenizer.decode(ids_of(c.logprobs)).rstrip("\ufffd") == c.text
    assert all(all(k.startswith("token_id:") for k in top) for top in c.logprobs.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True})
    for item in chat.choices[0].logprobs.content:
        assert re.fullmatch(r"token_id:\d+", item.token) and item.bytes == list(item.token.encode())
        assert all(t.token.startswith("token_id:") for t in item.top_logprobs)


# ---- streaming usage --------------------------------------------------------------------------


def test_continuous_usage_stats_put_the_running_usage_in_every_chunk(client):
    """Each chunk's usage counts the tokens streamed so far (its logprobs say how many it
    holds: chunks merge when the reader lags)."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, stream=True, logprobs=0,
                                            stream_options=options, extra_body={"ignore_eos": True}))
    running, sent = [], 0
    for ch in chunks[:-1]:
        sent += len(ch.choices[0].logprobs.tokens)
        running.append((ch.usage.completion_tokens, ch.usage.total_tokens - ch.usage.prompt_tokens))
        assert running[-1] == (sent, sent) and ch.usage.prompt_tokens == chunks[-1].usage.prompt_tokens
    assert sent == 6 and not chunks[-1].choices and chunks[-1].usage.completion_tokens == 6
    chat = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, stream=True, logprobs=True,
                                               stream_options=options, extra_body={"ignore_eos": True}))
    assert chat[0].usage.completion_tokens == 0  # the role chunk
    sent = 0
    for ch in chat[1:-1]:
        sent += len(ch.choices[0].logprobs.content)
        assert ch.usage.completion_tokens == sent
    assert sent == 5 and chat[-1].usage.completion_tokens == 5
    # Without include_usage, no usage at all (as vLLM).
    bare = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True,
                                          stream_options={"continuous_usage_stats": True}))
    assert all(ch.usage is None for ch in bare)


# ---- prompts: truncation and chat rendering ---------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_k(client):
    prompt = list(range(20, 60))
    cut = complete(client, prompt=prompt, max_tokens=6, extra_body={"truncate_prompt_tokens": 5})
    short = complete(client, prompt=prompt[-5:], max_tokens=6)
    assert cut.usage.prompt_tokens == 5 and cut.choices[0].text == short.choices[0].text
    long = complete(client, prompt=list(range(20, 220)), max_tokens=8, extra_body={"truncate_prompt_tokens": -1})
    assert long.usage.prompt_tokens == 120  # max_model_len 128 - max_tokens 8


def test_chat_template_kwargs_reach_the_template(client, tokenizer):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1,
        extra_body={"chat_template_kwargs": {"greeting": "Welcome, friend"}, "prompt_logprobs": 0},
    )
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, greeting="Welcome, friend")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert text.startswith("Welcome, friend\n") and r.usage.prompt_tokens == len(ids)
    assert [int(next(iter(e))) for e in r.model_extra["prompt_logprobs"][1:]] == ids[1:]


def test_continue_final_message_continues_the_assistant_turn(client, tokenizer):
    messages = MESSAGES + [{"role": "assistant", "content": "def greet(name):"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1,
        extra_body={"continue_final_message": True, "add_generation_prompt": False, "prompt_logprobs": 0},
    )
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True),
                           add_special_tokens=False)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\ndef greet(name):")
    assert [int(next(iter(e))) for e in r.model_extra["prompt_logprobs"][1:]] == ids[1:]


# ---- structured_outputs -----------------------------------------------------------------------


def test_structured_outputs_choice_regex_and_json(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                       extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].message.content in ("red", "green", "blue")
    r = complete(client, max_tokens=8, temperature=1.0, seed=2, extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", r.choices[0].text)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=32,
                                       extra_body={"structured_outputs": {"json": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


# ---- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"logit_bias": {"512": 1}}, "logit_bias", "outside the vocabulary [0, 512)"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "must be in [-100, 100]"),
        ({"logit_bias": {"five": 1}}, "logit_bias", "must be token ids"),
        ({"allowed_token_ids": [1, 512]}, "allowed_token_ids", "outside the vocabulary"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
        ({"bad_words": ["a", ""]}, "bad_words", "non-empty strings"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ">= 1, or -1"),
        ({"truncate_prompt_tokens": 200}, "truncate_prompt_tokens", "max_model_len - max_tokens = 128 - 4 = 124"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "greater than or equal to -1"),
        ({"repetition_penalty": 0}, "repetition_penalty", "> 0"),
        ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs", "not available when stream is true"),
        ({"prompt_logprobs": 50}, "prompt_logprobs", "at most 20"),
        # -1, the whole vocabulary, counts as its size against --max-logprobs (vLLM's rule)
        ({"prompt_logprobs": -1}, "prompt_logprobs", "at most 20 (the engine's max_logprobs), got -1 (the whole vocabulary, 512)"),
        ({"stream": True, "stream_options": {"continuous_usage": True}}, "stream_options", "stream_options.continuous_usage: Extra inputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
        ({"structured_outputs": {"regex": "[unclosed"}}, "structured_outputs", "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "a", "structural_tag": "x"}}, "structured_outputs", "structural_tag is not supported"),
        ({"structured_outputs": {"choice": ["a"]}, "guided_regex": "b"}, "guided_regex", "at most one output constraint"),
        ({"bad_word": ["a"]}, "bad_word", "unknown field(s): bad_word"),
    ],
)
def test_bad_fields_are_400s_naming_them(server, body, param, message):
    r = post(server, "completions", {"prompt": "hi", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message", "cannot both be true"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "may not set tokenize"),
        ({"chat_template_kwargs": "greeting"}, "chat_template_kwargs", "valid dictionary"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "at most 20 (the engine's max_logprobs), got -1"),
    ],
)
def test_bad_chat_fields_are_400s_naming_them(server, body, param, message):
    r = post(server, "chat/completions", {"messages": MESSAGES, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err
