"""``logprobs=-1`` / ``prompt_logprobs=-1``: the whole vocabulary, as vLLM's
``SamplingParams(logprobs=-1)``, bounded by ``max_logprobs`` as vLLM bounds it (-1 counts as
the vocabulary's size; ``--max-logprobs -1`` lifts the limit). At the server, vLLM's fields:
chat's ``top_logprobs`` and both routes' ``prompt_logprobs`` take -1; completions' ``logprobs``
does not (vLLM: "must be a positive value").

Oracle: Hugging Face ``transformers``' log-softmax over every token of the tiny model's
512-token vocabulary, through ``LLM`` and through a real ``pagelm serve`` on 127.0.0.1 with
the official ``openai`` client."""

import httpx
import openai
import pytest
import torch
from test_server import running_server
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagelm import LLM, SamplingParams

MODEL = "tiny"
VOCAB = 512  # the tiny model's


@pytest.fixture(scope="module")
def hf_logprobs(llama_dir):
    """Token ids -> HF's log-softmax of each position's logits, [len, vocab]."""
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].log_softmax(-1)

    return run


def assert_whole_row(entry: dict[int, float], ref_row: torch.Tensor) -> None:
    """``entry`` (token id -> logprob) holds every token of the vocabulary, each equal to HF's."""
    assert sorted(entry) == list(range(VOCAB))
    got = torch.tensor([entry[t] for t in range(VOCAB)])
    torch.testing.assert_close(got, ref_row, atol=1e-4, rtol=0)


# ---- LLM ----------------------------------------------------------------------------------


def test_minus_one_gives_every_tokens_logprob_equal_to_transformers(llama_dir, hf_logprobs):
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", max_logprobs=-1, num_kv_blocks=64)
    prompt = [1, 17, 99, 230, 5, 411, 64]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=-1, prompt_logprobs=-1)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    generated = out.outputs[0].token_ids
    ref = hf_logprobs(prompt + generated)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert_whole_row({t: lp.logprob for t, lp in entry.items()}, ref[pos - 1])
        chosen = prompt[pos]
        assert entry[chosen].rank == int((ref[pos - 1] > ref[pos - 1, chosen]).sum()) + 1
    for step, (token, entry) in enumerate(zip(generated, out.outputs[0].logprobs)):
        row = ref[len(prompt) - 1 + step]
        assert_whole_row({t: lp.logprob for t, lp in entry.items()}, row)
        assert token == int(row.argmax()) and entry[token].rank == 1  # greedy


def test_minus_one_counts_as_the_vocabulary_against_max_logprobs(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", max_logprobs=20, num_kv_blocks=64)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"{name} must be at most 20 .* got -1 \(the whole vocabulary, 512\)"):
            llm.generate("hi", SamplingParams(**{name: -1}), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs must be an integer >= 0, -1 for the whole vocabulary"):
        SamplingParams(logprobs=-2)


@pytest.mark.parametrize("max_logprobs", [-1, 1000])
@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_more_logprobs_than_the_vocabulary_is_a_value_error_and_the_engine_serves_on(llama_dir, name, max_logprobs):
    """max_logprobs -1 (no limit of its own) or past the vocabulary: the vocabulary is the bound."""
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", max_logprobs=max_logprobs, num_kv_blocks=64)
    with pytest.raises(ValueError, match=rf"^{name} must be at most {VOCAB} .*got {VOCAB + 1}$"):
        llm.generate("hi", SamplingParams(max_tokens=2, **{name: VOCAB + 1}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, **{name: VOCAB})
    out = llm.generate({"prompt_token_ids": [1, 17, 99]}, params, use_tqdm=False)[0]
    entries = out.outputs[0].logprobs if name == "logprobs" else out.prompt_logprobs[1:]
    assert len(out.outputs[0].token_ids) == 2 and all(len(e) == VOCAB for e in entries)


# ---- the server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(llama_dir):
    with running_server(
        str(llama_dir), "--served-model-name", MODEL, "--num-kv-blocks", "128", "--max-model-len", "128",
        "--dtype", "float32", "--max-logprobs", "-1",
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def test_chat_top_logprobs_minus_one_lists_the_whole_vocabulary(client, llama_dir, hf_logprobs):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    messages = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, logprobs=True, top_logprobs=-1,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, "prompt_logprobs": -1},
    )
    prompt = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    content = r.choices[0].logprobs.content
    generated = [int(c.token.removeprefix("token_id:")) for c in content]
    ref = hf_logprobs(prompt + generated)
    for step, c in enumerate(content):
        entry = {int(t.token.removeprefix("token_id:")): t.logprob for t in c.top_logprobs}
        assert len(c.top_logprobs) == VOCAB
        assert_whole_row(entry, ref[len(prompt) - 1 + step])
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
    entries = r.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    for pos, entry in enumerate(entries[1:], start=1):
        assert_whole_row({int(t): e["logprob"] for t, e in entry.items()}, ref[pos - 1])


def test_completion_prompt_logprobs_minus_one_lists_the_whole_vocabulary(client, llama_dir, hf_logprobs):
    prompt = [1, 40, 80, 120, 160]
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": -1},
    )
    entries, ref = r.choices[0].model_extra["prompt_logprobs"], hf_logprobs(prompt)
    assert entries[0] is None and len(entries) == len(prompt)
    for pos, entry in enumerate(entries[1:], start=1):
        assert_whole_row({int(t): e["logprob"] for t, e in entry.items()}, ref[pos - 1])


@pytest.mark.parametrize(
    "route, body, param, message",
    [
        # vLLM: completions' logprobs is "a positive value"; -1 is for prompt_logprobs / top_logprobs.
        ("completions", {"prompt": "hi", "logprobs": -1}, "logprobs", "greater than or equal to 0"),
        ("completions", {"prompt": "hi", "prompt_logprobs": -2}, "prompt_logprobs", "greater than or equal to -1"),
        ("completions", {"prompt": "hi", "prompt_logprobs": -1, "stream": True}, "prompt_logprobs",
         "not available when stream is true"),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": -1},
         "top_logprobs", "requires logprobs to be true"),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": -2},
         "top_logprobs", "greater than or equal to -1"),
    ],
)
def test_bad_minus_ones_are_400s_naming_the_field(server, route, body, param, message):
    r = httpx.post(f"{server}/v1/{route}", json={"model": MODEL, "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err
