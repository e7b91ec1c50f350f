"""Per-request logits processors (vLLM's ``logit_bias``, ``allowed_token_ids``, ``bad_words``)
and ``truncate_prompt_tokens`` through ``LLM.generate``. The oracles are the plain run: its
tokens, and its raw logprobs (a bias moves a logit by exactly its amount), under async
scheduling, speculative decoding and tensor parallelism too."""

from __future__ import annotations

import gc

import pytest
import torch

from pagelm import LLM, SamplingParams, StructuredOutputsParams
from pagelm.request import Request
from pagelm.worker.sampling_inputs import build_sampling_metadata
from pagelm.worker.step_state import CachedRequestState

PROMPT = "def add(a, b):"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def bad_word_in(tokenizer, ids: list[int]) -> tuple[int, str, list[list[int]]]:
    """A two-token word the run ``ids`` generates, as vLLM tokenizes ``bad_words``: (where its
    first token is, the word, its token sequences)."""
    for j in range(len(ids) - 1):
        word = tokenizer.decode(ids[j : j + 2])
        if not word.strip().isprintable() or not word.strip():
            continue
        forms = [tokenizer.encode(p + word.lstrip(), add_special_tokens=False) for p in ("", " ")]
        if list(ids[j : j + 2]) in forms:
            return j, word, forms
    raise AssertionError(f"no two-token word in {ids}")


@pytest.fixture(scope="module")
def llm(llama_dir):
    engine = LLM(str(llama_dir), dtype="float32", block_size=8)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def plain(llm):
    """The plain greedy run of PROMPT, with the raw top-20 logprobs of its first token."""
    out = llm.generate(PROMPT, greedy(logprobs=20), use_tqdm=False)[0].outputs[0]
    first = sorted(out.logprobs[0].items(), key=lambda kv: -kv[1].logprob)
    return out.token_ids, [(t, lp.logprob) for t, lp in first]


# ---- logit_bias -------------------------------------------------------------------------------


def test_logit_bias_of_100_makes_greedy_pick_the_token(llm):
    assert token_ids(llm, PROMPT, greedy(logit_bias={7: 100.0}))[0] == [7] * 16


def test_logit_bias_of_minus_100_forbids_the_token(llm, plain):
    first = plain[0][0]
    out = token_ids(llm, PROMPT, greedy(logit_bias={first: -100.0}))[0]
    assert first not in out and out[0] == plain[1][1][0]  # the runner-up takes its place


def test_logit_bias_moves_a_logit_by_exactly_its_amount(llm, plain):
    (top, top_lp), (second, second_lp) = plain[1][:2]
    gap = top_lp - second_lp  # logprob differences are logit differences
    assert token_ids(llm, PROMPT, greedy(1, logit_bias={second: gap + 1e-3}))[0] == [second]
    assert token_ids(llm, PROMPT, greedy(1, logit_bias={second: gap - 1e-3}))[0] == [top]
    assert token_ids(llm, PROMPT, greedy(1, logit_bias={str(second): gap + 1e-3}))[0] == [second]  # JSON keys


# ---- allowed_token_ids ------------------------------------------------------------------------


def test_allowed_token_ids_are_the_only_ones_sampled(llm):
    allowed = [10, 20, 30, 40]
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True, allowed_token_ids=allowed)
    out = token_ids(llm, [PROMPT, "x = "], params)
    assert all(set(o) <= set(allowed) for o in out) and len(set(out[0])) > 1


def test_greedy_with_allowed_token_ids_picks_the_likeliest_of_them(llm, plain):
    ranked = [t for t, _ in plain[1]]
    allowed = [ranked[4], ranked[2], ranked[9]]
    assert token_ids(llm, PROMPT, greedy(1, allowed_token_ids=allowed))[0] == [ranked[2]]


# ---- bad_words --------------------------------------------------------------------------------


def test_a_bad_word_of_two_tokens_is_never_completed(llm, plain):
    ids = plain[0]
    j, word, forms = bad_word_in(llm.get_tokenizer(), ids)
    out = token_ids(llm, PROMPT, greedy(bad_words=[word]))[0]
    assert not any(contains(out, f) for f in forms)
    # Same tokens up to the word's first token; its second is what the ban replaced.
    assert out[: j + 1] == ids[: j + 1] and out[j + 1] != ids[j + 1]


def test_a_bad_word_of_one_token_is_banned_everywhere(llm, plain):
    tokenizer = llm.get_tokenizer()
    first = plain[0][0]
    word = tokenizer.decode([first])
    assert tokenizer.encode(word.lstrip(), add_special_tokens=False) == [first] or tokenizer.encode(
        " " + word.lstrip(), add_special_tokens=False
    ) == [first]
    out = token_ids(llm, PROMPT, greedy(32, bad_words=[word]))[0]
    assert first not in out and first in plain[0]


# ---- cost and isolation -----------------------------------------------------------------------


def test_requests_without_them_are_token_identical_in_the_same_batch(llm, plain):
    prompts = [PROMPT, "import json\n", "x = ", "class Foo:"]
    alone = token_ids(llm, prompts, greedy())
    word = bad_word_in(llm.get_tokenizer(), plain[0])[1]
    mixed = [greedy(), greedy(logit_bias={7: 5.0, 9: -3.0}), greedy(), greedy(bad_words=[word], allowed_token_ids=list(range(100, 400)))]
    together = token_ids(llm, prompts, mixed)
    assert together[0] == alone[0] and together[2] == alone[2]
    assert together[1] != alone[1] and all(100 <= t < 400 for t in together[3])


def _state(params: SamplingParams, llm: LLM) -> CachedRequestState:
    llm.engine.inputs.check_params(params)  # tokenizes bad_words
    return CachedRequestState("r", [1, 2, 3, 4], 2, params, [0], False, output_token_ids=[3, 4])


def test_a_batch_without_them_builds_no_rows_and_no_bans(llm):
    md = build_sampling_metadata([_state(greedy(), llm)] * 3, frozenset({1}), 512, "cpu")
    assert md.logits_rows is None and md.logits_rows_index is None and md.banned_token_ids == {}


def test_only_bad_words_of_several_tokens_read_the_output_history(llm, plain):
    """Bias, allowed ids and one-token words are a row built once: an async step runs ahead."""
    tokenizer = llm.get_tokenizer()
    one = tokenizer.decode([plain[0][0]])
    two = bad_word_in(tokenizer, plain[0])[1]
    for params, reads in [
        (greedy(logit_bias={5: 1.0}), False), (greedy(allowed_token_ids=[5]), False),
        (greedy(bad_words=[one]), False), (greedy(bad_words=[two]), True),
    ]:
        llm.engine.inputs.check_params(params)
        assert Request("r", [1, 2], params).reads_output_history is reads


# ---- truncate_prompt_tokens -------------------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    prompt = list(range(20, 60))
    cut = llm.generate({"prompt_token_ids": prompt}, greedy(8, truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-5:]
    assert cut.outputs[0].token_ids == token_ids(llm, {"prompt_token_ids": prompt[-5:]}, greedy(8))[0]


def test_truncate_prompt_tokens_minus_one_fits_the_context(llama_dir):
    with LLM(str(llama_dir), dtype="float32", max_model_len=32) as small:
        prompt = list(range(20, 80))
        with pytest.raises(ValueError, match="max_model_len"):
            small.generate({"prompt_token_ids": prompt}, greedy(4), use_tqdm=False)
        out = small.generate({"prompt_token_ids": prompt}, greedy(4, truncate_prompt_tokens=-1), use_tqdm=False)[0]
        assert out.prompt_token_ids == prompt[-28:] and len(out.outputs[0].token_ids) == 4


def test_chat_continues_the_final_message_and_takes_template_kwargs(llm):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def greet(name):"}]
    out = llm.chat(messages, greedy(2), continue_final_message=True, use_tqdm=False)[0]
    assert out.prompt.endswith("<|im_start|>assistant\ndef greet(name):")  # open: no <|im_end|>
    assert out.prompt == llm.get_tokenizer().apply_chat_template(messages, tokenize=False, continue_final_message=True)
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = llm.chat(messages[:1], greedy(1), chat_template=template, chat_template_kwargs={"greeting": "Hey "},
                   use_tqdm=False)[0]
    assert out.prompt == "Hey hi"


# ---- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(logit_bias={512: 1.0}), "logit_bias has token ids \\[512\\] outside the vocabulary \\[0, 512\\)"),
        (dict(logit_bias={5: 100.5}), "logit_bias values must be in \\[-100, 100\\]"),
        (dict(logit_bias={"five": 1.0}), "logit_bias keys must be token ids"),
        (dict(allowed_token_ids=[3, 600]), "allowed_token_ids has token ids \\[600\\] outside the vocabulary"),
        (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
        (dict(bad_words=["ok", ""]), "bad_words must be a list of non-empty strings"),
        (dict(bad_words=[f"w{i}" for i in range(200)]), "bad_words must come to at most 128"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be an integer >= 1, or -1"),
        (dict(truncate_prompt_tokens=5000), "truncate_prompt_tokens must be at most max_model_len - max_tokens"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be a finite float > 0"),
    ],
)
def test_bad_values_raise_naming_the_parameter_and_range(llm, kw, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPT, greedy(**kw), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_repetition_penalty_above_2_is_allowed_as_in_vllm(llm):
    out = token_ids(llm, PROMPT, greedy(24, repetition_penalty=10.0))[0]
    assert len(set(out)) == len(out)  # every token already seen is pushed far down


def test_structured_outputs_is_vllms_newer_name_for_guided_decoding():
    constraint = StructuredOutputsParams(choice=["yes", "no"])
    params = SamplingParams(structured_outputs=constraint)
    assert params.guided_decoding is constraint and params.structured_outputs is constraint
    back = SamplingParams(**params.to_wire())  # the engine-core and rank wire
    assert back.structured_outputs == back.guided_decoding == constraint
    with pytest.raises(ValueError, match="structured_outputs and guided_decoding are the same constraint"):
        SamplingParams(structured_outputs=constraint, guided_decoding=StructuredOutputsParams(regex="a"))


# ---- async scheduling, speculative decoding, tensor parallelism -------------------------------


def _mixed_params(tokenizer, plain_ids) -> list[SamplingParams]:
    word = bad_word_in(tokenizer, plain_ids)[1]
    return [
        greedy(24),
        greedy(24, logit_bias={7: 3.0, 30: 2.5}),
        greedy(24, allowed_token_ids=list(range(50, 300))),
        greedy(24, bad_words=[word, tokenizer.decode([plain_ids[5]])]),
        SamplingParams(max_tokens=24, temperature=0.9, seed=11, ignore_eos=True, logit_bias={12: 4.0}, bad_words=[word]),
    ]


@pytest.fixture(scope="module")
def mixed(llm, plain):
    prompts = [PROMPT] * 5
    params = _mixed_params(llm.get_tokenizer(), plain[0])
    return prompts, params, token_ids(llm, prompts, params)


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(async_scheduling=True),
        dict(speculative_config=NGRAM),
        dict(tensor_parallel_size=2),
    ],
    ids=["async", "ngram", "tp2"],
)
def test_same_tokens_under_async_scheduling_speculation_and_tensor_parallelism(llama_dir, mixed, engine_args):
    prompts, params, expected = mixed
    with LLM(str(llama_dir), dtype="float32", block_size=8, **engine_args) as other:
        assert token_ids(other, prompts, params) == expected


def test_speculation_verifies_drafts_against_bad_words(llama_dir, llm):
    """A repetitive prompt: n-gram drafts that would complete the bad word are rejected."""
    prompt = {"prompt_token_ids": [40, 41, 42, 43, 44] * 4}
    base = token_ids(llm, prompt, greedy(24))[0]
    _, word, forms = bad_word_in(llm.get_tokenizer(), base)
    expected = token_ids(llm, prompt, greedy(24, bad_words=[word]))[0]
    with LLM(str(llama_dir), dtype="float32", block_size=8, speculative_config=NGRAM) as spec:
        out = spec.generate(prompt, greedy(24, bad_words=[word]), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == expected and not any(contains(expected, f) for f in forms)
        assert out.metrics.spec_num_draft_tokens > 0


@pytest.mark.gpu
def test_on_cuda_graphs_and_async_scheduling_give_the_eager_tokens(llama_dir, llm, plain):
    """On the GPU the rows are added inside the sampler that follows a graph replay, one step
    ahead under async scheduling: the same tokens as an eager, synchronous CUDA run, and a
    bias of 100 still decides greedy there."""
    prompts, params = [PROMPT] * 5, _mixed_params(llm.get_tokenizer(), plain[0])
    kw = dict(dtype="float32", block_size=8, device="cuda", num_kv_blocks=512)
    eager = LLM(str(llama_dir), enforce_eager=True, async_scheduling=False, **kw)
    expected = token_ids(eager, prompts, params)
    eager.shutdown()
    del eager
    gc.collect()
    torch.cuda.empty_cache()  # the next engine sizes its KV pool from what is free
    with LLM(str(llama_dir), async_scheduling=True, **kw) as fast:
        got = token_ids(fast, prompts, params)
        forced = token_ids(fast, [PROMPT], greedy(8, logit_bias={42: 100.0}))[0]
    assert got == expected
    assert forced == [42] * 8
