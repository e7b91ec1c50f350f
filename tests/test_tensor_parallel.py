"""Tensor parallelism on the CPU: ranks are local processes (the ``mp`` executor) joined over
gloo, each holding its slice of every layer. The oracle is the one-rank run: greedy and
seeded-sampling token ids identical in float32 for every built-in architecture, with key/value
heads replicated when there are more ranks than kv heads, a vocabulary that does not split
evenly, tied embeddings, and under chunked prefill, prefix caching and preemption."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pagelm import LLM, SamplingParams
from pagelm.distributed import parallel_state

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _prompts(n: int, length: int = 5) -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(length)]} for i in range(n)]


def _run(model_dir, prompts, params, **kw):
    llm = LLM(str(model_dir), dtype="float32", **kw)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    return outs


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_tp2_greedy_equals_one_rank(make_model, arch):
    model_dir = make_model(arch, arch)
    prompts = _prompts(4)
    assert _ids(_run(model_dir, prompts, GREEDY, tensor_parallel_size=2)) == _ids(_run(model_dir, prompts, GREEDY))


def test_more_ranks_than_kv_heads_and_an_uneven_tied_vocabulary(make_model):
    # 4 ranks over 2 kv heads: each kv head on two ranks. 517 rows do not split in 4.
    model_dir = make_model("llama-odd-vocab", "llama", vocab_size=517, tie_word_embeddings=True)
    prompts = _prompts(3)
    assert _ids(_run(model_dir, prompts, GREEDY, tensor_parallel_size=4)) == _ids(_run(model_dir, prompts, GREEDY))


def test_seeded_sampling_and_logprobs_equal_one_rank(llama_dir):
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=1234, logprobs=3, prompt_logprobs=2)
    prompts = _prompts(3)
    one, two = _run(llama_dir, prompts, params), _run(llama_dir, prompts, params, tensor_parallel_size=2)
    assert _ids(two) == _ids(one)
    for a, b in zip(one, two):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
        assert [p and sorted(p) for p in a.prompt_logprobs] == [p and sorted(p) for p in b.prompt_logprobs]


def test_chunked_prefill_prefix_caching_and_preemption_equal_the_plain_run(llama_dir):
    # Long shared-prefix prompts, chunks of 16 tokens, and a pool too small for all of them:
    # requests are preempted and recomputed, prefixes hit the cache.
    shared = list(range(40, 72))
    prompts = [{"prompt_token_ids": shared + [100 + i, 101, 102 + i]} for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = _ids(_run(llama_dir, prompts, params))
    llm = LLM(str(llama_dir), dtype="float32", tensor_parallel_size=2, num_kv_blocks=12, block_size=8,
              max_num_batched_tokens=16, max_model_len=64)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        core = llm.engine.core
        preemptions, hits = core.scheduler.num_preemptions, core.kv_cache_manager.prefix_cache_stats.hits
    finally:
        llm.shutdown()
    assert _ids(outs) == plain
    assert preemptions > 0 and hits > 0


def test_async_scheduling_under_tp2_equals_the_plain_run(llama_dir):
    # CUDA turns async scheduling on by default; a step launched ahead must reach the other
    # ranks too (it did not: on two H100s rank 0 waited in its first all-reduce forever).
    shared = list(range(40, 72))
    prompts = [{"prompt_token_ids": shared + [100 + i, 101, 102 + i]} for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = _ids(_run(llama_dir, prompts, params))
    llm = LLM(str(llama_dir), dtype="float32", tensor_parallel_size=2, async_scheduling=True, num_kv_blocks=12,
              block_size=8, max_num_batched_tokens=16, max_model_len=64)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.core.async_scheduling and llm.engine.core.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()
    assert _ids(outs) == plain


def test_each_rank_holds_its_slice(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", tensor_parallel_size=2)
    try:
        attn = llm.engine.core.runner.model.model.layers[0].self_attn
        # 4 query heads and 2 kv heads of 16 dims over 2 ranks: 2 + 1 + 1 heads here.
        assert attn.qkv_proj.weight.shape == (4 * 16, 64)
        assert attn.o_proj.weight.shape == (64, 32)
        assert (attn.attn.spec.num_heads, attn.attn.spec.num_kv_heads) == (2, 1)
        assert parallel_state().tp_size == 2
    finally:
        llm.shutdown()
    assert parallel_state().tp_size == 1


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"tensor_parallel_size": 3}, "tensor_parallel_size=3 must divide num_attention_heads=4"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, "'uni' runs one rank"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "nope"}, "unknown executor 'nope'.*mp"),
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be >= 1"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
    ],
)
def test_bad_parallel_config_is_a_clear_error(llama_dir, kw, match):
    with pytest.raises(Exception, match=match):
        LLM(str(llama_dir), dtype="float32", **kw)
    assert parallel_state().tp_size == 1


def test_a_dead_rank_is_named_not_a_hang(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", tensor_parallel_size=2, distributed_timeout=20)
    try:
        (proc,) = llm.engine.core.executor._procs
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 \(tensor-parallel rank 1 of pipeline stage 0\) is not running"):
            llm.generate(_prompts(1), GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 20
    finally:
        llm.shutdown()


def test_async_engine_in_its_own_process_runs_tp2(llama_dir):
    """The server's path: the engine core in its own process is rank 0 and starts rank 1."""
    import asyncio

    from pagelm.engine.async_llm import AsyncLLM

    async def tokens(engine, prompt, request_id):
        ids = []
        async for out in engine.generate(prompt, GREEDY, request_id):  # streamed deltas
            ids += out.outputs[0].token_ids
        return ids

    loop = asyncio.new_event_loop()
    engine = AsyncLLM.from_model(str(llama_dir), dtype="float32", tensor_parallel_size=2)
    try:
        async def all_prompts():
            return await asyncio.gather(*(tokens(engine, p, f"r{i}") for i, p in enumerate(_prompts(3))))

        got = loop.run_until_complete(all_prompts())
    finally:
        engine.shutdown()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
    assert list(got) == _ids(_run(llama_dir, _prompts(3), GREEDY))
