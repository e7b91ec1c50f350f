"""Randomized arrivals, aborts, chunking, prefix hits and preemptions of prompts with images,
with the plain run as the oracle.

Each case adds prompts that share text prefixes and images (so prefix-cache and encoder-cache
hits happen) at random steps into a LLaVA engine with a small KV pool, chunked prefill, a
small encoder budget and cache, and FCFS or a policy that preempts at random; some are
aborted part-way. Every request that was not aborted must produce exactly the greedy tokens of
its prompt run alone; once idle, every KV block is free, no image is referenced, and the
runner holds no embeddings the scheduler has forgotten.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from PIL import Image

from chaos_policy import chaos_policy, drive  # noqa: F401 (chaos_policy registers the policy here)

from pagelm import LLM, SamplingParams
from pagelm.models.testing import build_tiny_llava

BLOCK_SIZE = 4
MAX_MODEL_LEN = 96
PREFIXES = [[5 + (7 * i) % 50 for i in range(n)] for n in (0, 6, 13)]
# 16 embeddings each; the last has the first one's pixels (one encoder entry for both).
IMAGES = [
    Image.fromarray(np.random.RandomState(s).randint(0, 256, (h, w, 3), dtype=np.uint8))
    for s, h, w in ((0, 40, 60), (1, 28, 28), (2, 90, 30), (0, 40, 60))
]


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("llava-prop") / "tiny-llava")


@pytest.fixture(scope="module")
def image_token(llava_dir):
    import json

    return json.loads((llava_dir / "config.json").read_text())["image_token_index"]


def build_prompt(r: dict, image_token: int) -> tuple[list[int], list[Image.Image]]:
    """Prefix, then the tail with one placeholder per image at its drawn place."""
    ids = list(PREFIXES[r["prefix"]])
    tail = list(r["tail"])
    for where, _ in sorted(zip(r["image_at"], r["images"]), reverse=True):
        tail.insert(min(where, len(tail)), image_token)
    return ids + tail, [IMAGES[i] for i in r["images"]]


@pytest.fixture(scope="module")
def solo(llava_dir):
    llm = LLM(str(llava_dir), device="cpu", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
              enable_prefix_caching=False)
    cache: dict = {}

    def run(prompt: list[int], images: list, max_tokens: int) -> list[int]:
        key = (tuple(prompt), tuple(id(i) for i in images), max_tokens)
        if key not in cache:
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            p = {"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}
            cache[key] = list(llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids)
        return cache[key]

    yield run
    llm.shutdown()


request_st = st.fixed_dictionaries({
    "prefix": st.integers(0, len(PREFIXES) - 1),
    "tail": st.lists(st.integers(5, 300), min_size=1, max_size=8),
    "images": st.lists(st.integers(0, len(IMAGES) - 1), min_size=0, max_size=2),
    "image_at": st.lists(st.integers(0, 8), min_size=2, max_size=2),
    "max_tokens": st.integers(1, 5),
    "arrival": st.integers(0, 6),
    "abort_at": st.one_of(st.none(), st.integers(0, 8)),
})

case_st = st.fixed_dictionaries({
    "requests": st.lists(request_st, min_size=1, max_size=5),
    "policy": st.sampled_from(["fcfs", "chaos"]),
    "prefix_caching": st.booleans(),
    "async_scheduling": st.booleans(),
    "num_kv_blocks": st.integers(MAX_MODEL_LEN // BLOCK_SIZE, 48),
    "max_num_seqs": st.integers(1, 3),
    "max_num_batched_tokens": st.sampled_from([6, 16, 64]),
    "max_num_encoder_input_tokens": st.sampled_from([16, 40]),
    "encoder_cache_size": st.sampled_from([16, 32, 64]),
    "seed": st.integers(0, 2**16),
})


def run_case(llava_dir, image_token: int, case: dict):
    llm = LLM(
        str(llava_dir), device="cpu", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
        num_kv_blocks=case["num_kv_blocks"], max_num_seqs=case["max_num_seqs"],
        max_num_batched_tokens=case["max_num_batched_tokens"],
        max_num_encoder_input_tokens=case["max_num_encoder_input_tokens"],
        encoder_cache_size=case["encoder_cache_size"], enable_prefix_caching=case["prefix_caching"],
        scheduling_policy=case["policy"], async_scheduling=case["async_scheduling"],
        plugin_config={"chaos_seed": case["seed"]},
    )
    engine = llm.engine
    pending = sorted(enumerate(case["requests"]), key=lambda item: item[1]["arrival"])

    def add(i, r):
        prompt, images = build_prompt(r, image_token)
        sp = SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
        engine.add_request(str(i), {"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}, sp)

    finished, aborted = drive(engine, pending, add, 3000, case)
    return finished, aborted, engine.core


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.generate])  # shrinking an engine run takes minutes
@given(case=case_st)
def test_images_under_random_scheduling_give_the_solo_outputs(llava_dir, image_token, solo, case):
    finished, aborted, core = run_case(llava_dir, image_token, case)
    for i, r in enumerate(case["requests"]):
        if str(i) in aborted:
            continue
        prompt, images = build_prompt(r, image_token)
        assert finished[str(i)] == solo(prompt, images, r["max_tokens"]), f"request {i} differs under {case}"
    kv, cache = core.kv_cache_manager, core.scheduler.encoder_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert not cache.refs and not cache.req_refs
    assert cache.num_free_slots + cache.num_freeable == cache.cache_size
    assert set(core.runner.encoder_cache) <= set(cache.sizes) | set(cache.evicted)
