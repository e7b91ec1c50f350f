"""Speculative and guided decoding under tensor parallelism (TP=2 over gloo on the CPU, the
``mp`` executor): rank 0 schedules, every step's drafts and grammar bitmask reach the other
rank in the step message as plain data, and the greedy token ids are those of the one-rank
run, for n-gram and EAGLE drafts, xgrammar constraints, and both at once."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from pagelm import LLM, GuidedDecodingParams, SamplingParams
from pagelm.plugins.spec_decode.eagle_train import EagleTrainConfig, train_eagle_head

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
# Prompts that repeat themselves: the n-gram proposer finds drafts in them.
REPEATING = [{"prompt_token_ids": [40, 41, 42, 43, 44] * 6}, {"prompt_token_ids": [7, 8, 9] * 8}, {"prompt_token_ids": [3, 4]}]
# The random model would emit whitespace between JSON tokens for ever.
GUIDED_ARGS = dict(plugin_config={"xgrammar": {"any_whitespace": False}})


def _generate(model_dir, prompts, params, **kw):
    llm = LLM(str(model_dir), dtype="float32", block_size=8, **kw)
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _drafted(outs) -> int:
    return sum(o.metrics.spec_num_draft_tokens for o in outs)


def test_ngram_drafts_under_tp2_give_the_one_rank_tokens(llama_dir):
    one = _generate(llama_dir, REPEATING, GREEDY)
    two = _generate(llama_dir, REPEATING, GREEDY, tensor_parallel_size=2, speculative_config=NGRAM)
    assert _ids(two) == _ids(one)
    assert _drafted(two) > 0 and sum(o.metrics.spec_num_accepted_tokens for o in two) > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_eagle_drafts_under_tp2_give_the_one_rank_tokens(llama_dir, tmp_path, async_scheduling):
    # The head's decoder layer is split over the ranks like the target's; it shares the
    # target's vocabulary-parallel embedding and LM head, so both ranks run every draft pass.
    # With async scheduling, steps where nobody drafts run ahead, and the other rank keeps
    # them in flight as rank 0 does: its head's passes must meet rank 0's all the same.
    train_eagle_head(llama_dir, tmp_path / "head", EagleTrainConfig(steps=0), log=lambda *_: None)
    eagle = {"method": "eagle", "num_speculative_tokens": 2, "model": str(tmp_path / "head")}
    one = _generate(llama_dir, REPEATING, GREEDY)
    one_eagle = _generate(llama_dir, REPEATING, GREEDY, speculative_config=eagle)
    two = _generate(llama_dir, REPEATING, GREEDY, tensor_parallel_size=2, speculative_config=eagle,
                    async_scheduling=async_scheduling)
    assert _ids(two) == _ids(one) == _ids(one_eagle)
    assert _drafted(two) > 0
    # Rank 0's drafts are the one-rank head's: the same acceptance, request by request.
    assert [o.metrics.spec_num_accepted_tokens for o in two] == [o.metrics.spec_num_accepted_tokens for o in one_eagle]


def test_eagle_drafts_over_a_draft_vocabulary_under_tp2_as_on_one_rank(llama_dir, tmp_path):
    # Each rank gathers the draft vocabulary's LM head rows from both ranks' halves at load
    # (the embedding's lookup), then drafts over them alone, without a gather per pass. The
    # vocabulary is the upper half of the ids, all of them held by rank 1: rank 0 drafts what
    # one rank drafts only with rank 1's rows.
    train_eagle_head(llama_dir, tmp_path / "head", EagleTrainConfig(steps=0), log=lambda *_: None)
    weights = load_file(str(tmp_path / "head" / "model.safetensors"))
    save_file({**weights, "draft_vocab": torch.arange(256, 512)}, str(tmp_path / "head" / "model.safetensors"))
    eagle = {"method": "eagle", "num_speculative_tokens": 2, "model": str(tmp_path / "head"), "adaptive": False}
    one = _generate(llama_dir, REPEATING, GREEDY)
    one_eagle = _generate(llama_dir, REPEATING, GREEDY, speculative_config=eagle)
    two = _generate(llama_dir, REPEATING, GREEDY, tensor_parallel_size=2, speculative_config=eagle)
    assert _ids(two) == _ids(one) == _ids(one_eagle)
    assert _drafted(two) > 0 and sum(o.metrics.spec_num_accepted_tokens for o in two) > 0
    assert [o.metrics.spec_num_accepted_tokens for o in two] == [o.metrics.spec_num_accepted_tokens for o in one_eagle]


def _guided_batch(llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    regex, choice = r"(ab|ba){2,6}c", ["la la la la", "na na", "no"]
    prompts = [
        {"prompt_token_ids": tokenizer.encode("abbaab" * 4)},
        {"prompt_token_ids": tokenizer.encode("la la na na " * 3)},
        {"prompt_token_ids": [5, 6, 7]},
        {"prompt_token_ids": [40, 41, 42, 43, 44] * 6},  # unconstrained, beside them
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, guided_decoding=GuidedDecodingParams(regex=regex)),
        SamplingParams(temperature=0.0, max_tokens=40, guided_decoding=GuidedDecodingParams(choice=choice)),
        SamplingParams(temperature=0.0, max_tokens=40, guided_decoding=GuidedDecodingParams(regex=r"[a-z]{5,9}")),
        GREEDY,
    ]
    return prompts, params, regex, choice


def test_guided_decoding_under_tp2_gives_the_one_rank_tokens(llama_dir):
    prompts, params, regex, choice = _guided_batch(llama_dir)
    one = _generate(llama_dir, prompts, params, **GUIDED_ARGS)
    two = _generate(llama_dir, prompts, params, tensor_parallel_size=2, **GUIDED_ARGS)
    assert _ids(two) == _ids(one)
    assert re.fullmatch(regex, two[0].outputs[0].text) and two[1].outputs[0].text in choice
    assert re.fullmatch(r"[a-z]{5,9}", two[2].outputs[0].text)


def test_guided_decoding_with_ngram_drafts_under_tp2_gives_the_one_rank_tokens(llama_dir):
    # Each guided request's verification rows are masked with the bitmask rows after its
    # drafts: those rows travel to rank 1 too.
    prompts, params, regex, choice = _guided_batch(llama_dir)
    one = _generate(llama_dir, prompts, params, **GUIDED_ARGS)
    two = _generate(llama_dir, prompts, params, tensor_parallel_size=2, speculative_config=NGRAM, **GUIDED_ARGS)
    assert _ids(two) == _ids(one)
    assert two[0].metrics.spec_num_draft_tokens > 0 and _drafted(two[:3]) > 0
    assert re.fullmatch(regex, two[0].outputs[0].text) and two[1].outputs[0].text in choice


def test_guided_decoding_under_tp2_with_async_scheduling_gives_the_one_rank_tokens(llama_dir):
    # A guided step is sent with its bitmask, so the step before it is finished first.
    prompts, params, _, _ = _guided_batch(llama_dir)
    one = _generate(llama_dir, prompts, params, **GUIDED_ARGS)
    two = _generate(llama_dir, prompts, params, tensor_parallel_size=2, async_scheduling=True, **GUIDED_ARGS)
    assert _ids(two) == _ids(one)
