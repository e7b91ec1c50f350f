"""Scheduling features change when work happens, never what comes out: prefix caching,
chunked prefill, preemption and batch size all give the plain run's tokens."""

import pytest
import torch

from pagelm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def workload(vocab_size, n=12, seed=1):
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(5, vocab_size, (40,), generator=gen).tolist()
    out = []
    for i in range(n):
        tail = torch.randint(5, vocab_size, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen)
        # Half the prompts share a 40-token prefix, so prefix caching has something to hit.
        out.append((shared if i % 2 else []) + tail.tolist())
    return [{"prompt_token_ids": p} for p in out]


def run(model_dir, prompts, params=GREEDY, **kw):
    llm = LLM(str(model_dir), dtype="float32", block_size=8, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    core = llm.engine.core
    assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks, "KV blocks leaked"
    return [[c.token_ids for c in o.outputs] for o in outs], core


@pytest.fixture(scope="module")
def setup(llama_dir):
    from transformers import AutoConfig

    prompts = workload(AutoConfig.from_pretrained(llama_dir).vocab_size)
    baseline, _ = run(llama_dir, prompts, enable_prefix_caching=False)
    return llama_dir, prompts, baseline


def test_prefix_caching_gives_the_same_tokens_and_hits(setup):
    model_dir, prompts, baseline = setup
    outs, core = run(model_dir, prompts, enable_prefix_caching=True)
    assert outs == baseline
    assert core.kv_cache_manager.prefix_cache_stats.hits > 0


def test_chunked_prefill_gives_the_same_tokens(setup):
    model_dir, prompts, baseline = setup
    outs, _ = run(model_dir, prompts, max_num_batched_tokens=7, enable_prefix_caching=False)
    assert outs == baseline


def test_long_prefill_threshold_and_partial_prefills_give_the_same_tokens(setup):
    model_dir, prompts, baseline = setup
    outs, _ = run(model_dir, prompts, long_prefill_token_threshold=5, max_num_partial_prefills=2)
    assert outs == baseline


def test_preemption_gives_the_same_tokens(setup):
    model_dir, prompts, baseline = setup
    # 16 blocks x 8 = 128 slots for 12 requests of up to ~93 tokens each: constant preemption.
    outs, core = run(model_dir, prompts, num_kv_blocks=16, max_model_len=128)
    assert outs == baseline
    assert core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("max_num_seqs", [1, 32])
def test_batch_size_does_not_change_tokens(setup, max_num_seqs):
    model_dir, prompts, baseline = setup
    outs, _ = run(model_dir, prompts, max_num_seqs=max_num_seqs)
    assert outs == baseline


def test_seeded_n3_sampling_is_reproducible_across_batching(setup):
    model_dir, prompts, _ = setup
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    a, _ = run(model_dir, prompts[:4], params, max_num_seqs=32)
    b, _ = run(model_dir, prompts[:4], params, max_num_seqs=1, num_kv_blocks=24, max_model_len=128)
    assert a == b
    assert all(len(set(map(tuple, samples))) > 1 for samples in a), "the 3 samples should differ"


def test_n3_children_share_the_prompt_blocks(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", block_size=8)
    prompt = {"prompt_token_ids": list(range(10, 42))}  # 4 full blocks
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs) == 3
    stats = llm.engine.core.kv_cache_manager.prefix_cache_stats
    assert stats.hits == 2 * 24  # children 2 and 3 reuse 3 blocks (the last token is recomputed)
