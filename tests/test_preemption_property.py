"""Randomized arrivals, priorities, aborts and preemptions, with the plain run as the oracle.

Each case draws a handful of prompts that share prefixes (so prefix-cache hits happen, also
within one step), adds them at random steps with random priorities into an engine with a
small KV pool, chunked prefill, a random policy (every built-in one and ``chaos``, which
preempts at random) and, often, a CPU tier that victims are swapped to and evicted prefix
blocks spill to, some of them aborted part-way. Every request that was not aborted must
produce exactly the greedy tokens of its prompt run alone, and once the engine is idle every
KV block is free again.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chaos_policy import chaos_policy, drive  # noqa: F401 (chaos_policy registers the policy here)

from pagelm import LLM, SamplingParams

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
PREFIXES = [[5 + (7 * i) % 50 for i in range(n)] for n in (0, 9, 17)]


@pytest.fixture(scope="module")
def solo(llama_dir):
    """Greedy tokens of one prompt run alone on a roomy engine, cached per prompt."""
    llm = LLM(str(llama_dir), device="cpu", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
              enable_prefix_caching=False)
    cache: dict[tuple[int, ...], list[int]] = {}

    def run(prompt: list[int], max_tokens: int) -> list[int]:
        key = tuple(prompt)
        if key not in cache or len(cache[key]) < max_tokens:
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
            cache[key] = list(out.outputs[0].token_ids)
        return cache[key][:max_tokens]

    return run


request_st = st.fixed_dictionaries({
    "prefix": st.sampled_from(range(len(PREFIXES))),
    # A short tail that often repeats itself (the n-gram proposer then drafts).
    "tail": st.lists(st.integers(3, 40), min_size=1, max_size=20),
    "arrival": st.integers(0, 6),
    "priority": st.integers(0, 3),
    "max_tokens": st.integers(1, 8),
    "abort_at": st.none() | st.integers(1, 30),
})

case_st = st.fixed_dictionaries({
    "requests": st.lists(request_st, min_size=3, max_size=8),
    "policy": st.sampled_from(["fcfs", "priority", "sjf", "chaos"]),
    "prefix_caching": st.booleans(),
    "speculative": st.booleans(),
    "async_scheduling": st.booleans(),
    # From a pool that holds one max_model_len sequence (constant preemption) to a roomy one
    # (freed blocks keep their hashes long enough to be hit again).
    "num_kv_blocks": st.integers(MAX_MODEL_LEN // BLOCK_SIZE, 48),
    "max_num_seqs": st.integers(1, 3),
    "max_num_batched_tokens": st.sampled_from([6, 16, 64]),
    "long_prefill_token_threshold": st.sampled_from([0, 4, 8]),
    "seed": st.integers(0, 2**16),
    # A CPU tier (swap preemption, prefix spill) of none, a few or plenty of blocks.
    "cpu_blocks": st.sampled_from([0, 0, 6, 64]),
    "preemption_mode": st.sampled_from(["auto", "swap", "recompute"]),
})


def _engine_args(case: dict) -> dict:
    args = dict(
        device="cpu", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
        num_kv_blocks=case["num_kv_blocks"], max_num_seqs=case["max_num_seqs"],
        max_num_batched_tokens=case["max_num_batched_tokens"],
        long_prefill_token_threshold=case["long_prefill_token_threshold"],
        enable_prefix_caching=case["prefix_caching"], scheduling_policy=case["policy"],
        async_scheduling=case["async_scheduling"], plugin_config={"chaos_seed": case["seed"]},
    )
    if case["cpu_blocks"]:
        args.update(num_cpu_blocks=case["cpu_blocks"], preemption_mode=case["preemption_mode"])
    if case["speculative"]:
        args["speculative_config"] = {
            "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        }
    return args


def run_case(llama_dir, case: dict) -> tuple[dict[str, list[int]], set[str], object]:
    """Drive one engine through the case; returns the finished requests' tokens, the ids
    aborted before they finished, and the engine core."""
    llm = LLM(str(llama_dir), **_engine_args(case))
    engine = llm.engine
    pending = sorted(enumerate(case["requests"]), key=lambda item: item[1]["arrival"])

    def add(i, r):
        sp = SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
        engine.add_request(str(i), {"prompt_token_ids": PREFIXES[r["prefix"]] + r["tail"]}, sp, priority=r["priority"])

    finished, aborted = drive(engine, pending, add, 5000, case)
    return finished, aborted, engine.core


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=case_st)
def test_random_arrivals_and_preemptions_give_the_solo_outputs(llama_dir, solo, case):
    finished, aborted, core = run_case(llama_dir, case)
    for i, r in enumerate(case["requests"]):
        if str(i) in aborted:
            continue
        prompt = PREFIXES[r["prefix"]] + r["tail"]
        assert finished[str(i)] == solo(prompt, r["max_tokens"]), (
            f"request {i} ({len(prompt)} prompt tokens) differs from its solo run under {case}"
        )
    kv = core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert not kv.req_to_blocks
    if kv.offload is not None:  # the CPU tier: nobody swapped, every block free
        assert not kv.offload.swapped and kv.offload.num_free_blocks == case["cpu_blocks"]
