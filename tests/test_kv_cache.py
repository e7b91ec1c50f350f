"""KV cache manager: block pool, free queue, hash chain, prefix hits, lazy eviction."""

import pytest

from pagelm.kv_cache import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    KVCacheManager,
    hash_block_tokens,
    make_block_hasher,
)
from pagelm.request import Request
from pagelm.sampling_params import SamplingParams

BS = 4


def make_request(req_id, tokens, salt=None, **params):
    return Request(
        req_id,
        tokens,
        SamplingParams(**params),
        cache_salt=salt,
        block_hasher=make_block_hasher(BS),
    )


@pytest.fixture
def kv():
    manager = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    yield manager
    # Every test must leave the pool whole once its requests are freed.
    assert manager.num_free_blocks == manager.num_blocks


def admit(kv, req):
    hits, num_hit = kv.get_computed_blocks(req)
    blocks = kv.allocate_slots(req, req.num_tokens - num_hit, new_computed_blocks=hits)
    assert blocks is not None
    req.num_computed_tokens = req.num_tokens
    return num_hit


def test_free_queue_removes_from_middle_and_keeps_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert q.num_free_blocks == 4
    q.append(blocks[2])
    assert q.popleft().block_id == 0
    assert [b.block_id for b in q] == [1, 3, 4, 2]


def test_hash_chain_differs_by_position():
    tokens = [1, 2, 3, 4]
    first = hash_block_tokens(None, tokens)
    second = hash_block_tokens(first, tokens)
    assert first != second
    req = make_request("a", tokens * 2)
    assert req.block_hashes == [first, second]


def test_hash_chain_differs_by_cache_salt():
    a = make_request("a", list(range(8)), salt="tenant-a")
    b = make_request("b", list(range(8)), salt="tenant-b")
    c = make_request("c", list(range(8)))
    assert a.block_hashes[0] != b.block_hashes[0] != c.block_hashes[0]
    assert a.block_hashes[1] != b.block_hashes[1]


def test_only_full_blocks_are_hashed_and_outputs_extend_the_chain():
    req = make_request("a", list(range(6)))
    assert len(req.block_hashes) == 1
    req.append_output_token_ids([6, 7])
    assert len(req.block_hashes) == 2
    assert req.block_hashes[1] == hash_block_tokens(req.block_hashes[0], [4, 5, 6, 7])


def test_prefix_hit_shares_blocks_and_counts_refs(kv):
    a = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert admit(kv, a) == 0
    b = make_request("b", list(range(8)) + [99, 98, 97])
    assert admit(kv, b) == 8
    assert kv.get_block_ids("a")[:2] == kv.get_block_ids("b")[:2]
    shared = kv.pool.blocks[kv.get_block_ids("a")[0]]
    assert shared.ref_cnt == 2
    kv.free(a)
    assert shared.ref_cnt == 1
    kv.free(b)


def test_salted_request_misses_unsalted_cache(kv):
    a = make_request("a", list(range(9)))
    admit(kv, a)
    b = make_request("b", list(range(9)), salt="s")
    assert admit(kv, b) == 0
    kv.free(a)
    kv.free(b)


def test_full_prompt_hit_still_recomputes_last_token(kv):
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(8)))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4  # block 2 would cover the last token, which must be recomputed
    assert len(hits) == 1


def test_lazy_eviction_reuses_freed_block_cache_entry(kv):
    a = make_request("a", list(range(8)))
    admit(kv, a)
    block_ids = kv.get_block_ids("a")
    kv.free(a)
    assert kv.num_free_blocks == kv.num_blocks
    # Freed but still cached: a new request with the same prefix gets the very same block.
    b = make_request("b", list(range(8)) + [5])
    assert admit(kv, b) == 8
    assert kv.get_block_ids("b")[:2] == block_ids
    kv.free(b)


def test_eviction_drops_hash_when_block_is_reused(kv):
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    # Take every block: the cached ones get evicted and lose their hashes.
    c = make_request("c", list(range(100, 140)))
    assert admit(kv, c) == 0
    assert kv.pool.cached_blocks.keys().isdisjoint(a.block_hashes)
    kv.free(c)
    b = make_request("b", list(range(8)) + [5])
    assert kv.get_computed_blocks(b)[1] == 0


def test_allocate_returns_none_when_pool_is_short_and_changes_nothing(kv):
    a = make_request("a", list(range(36)))  # 9 blocks of 10
    admit(kv, a)
    b = make_request("b", list(range(100, 108)))
    assert kv.allocate_slots(b, 8) is None
    assert kv.num_free_blocks == 1
    assert kv.get_block_ids("b") == []
    kv.free(a)


def test_lookahead_slots_are_allocated_but_not_cached(kv):
    a = make_request("a", list(range(4)))
    blocks = kv.allocate_slots(a, 4, num_lookahead_tokens=4)
    assert len(blocks) == 2
    assert len(kv.pool.cached_blocks) == 1
    kv.free(a)


def test_usage_and_free_blocks(kv):
    a = make_request("a", list(range(20)))
    admit(kv, a)
    assert kv.num_free_blocks == 5
    assert kv.usage() == pytest.approx(0.5)
    kv.free(a)
    assert kv.usage() == 0.0



def test_a_prompt_is_hashed_once_by_the_engine_core(llama_dir, monkeypatch):
    """The API side builds requests without hashes; the engine core hashes each prompt block
    once as the request arrives."""
    import pagelm.kv_cache.block_hash as block_hash
    from pagelm import LLM

    llm = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=4)
    calls = []
    real = block_hash.hash_block_tokens
    monkeypatch.setattr(block_hash, "hash_block_tokens", lambda *a: calls.append(a[1]) or real(*a))
    prompt = list(range(5, 15))  # 10 tokens: 2 full blocks of 4
    llm.engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))
    request = llm.engine.core.scheduler.requests["r"]
    assert [list(c) for c in calls] == [prompt[:4], prompt[4:8]]
    assert len(request.block_hashes) == 2
    llm.engine.abort_request(["r"])


def test_the_api_process_never_hashes_and_the_engine_process_still_hits(llama_dir, monkeypatch):
    """Across the engine-process boundary the prompt was hashed on both sides."""
    import asyncio

    import pagelm.kv_cache.block_hash as block_hash
    from pagelm.engine.async_llm import AsyncLLM

    calls = []
    real = block_hash.hash_block_tokens
    monkeypatch.setattr(block_hash, "hash_block_tokens", lambda *a: calls.append(1) or real(*a))
    prompt = {"prompt_token_ids": list(range(5, 45))}

    async def go(engine):
        cached = []
        for i in range(2):
            async for out in engine.generate(prompt, SamplingParams(max_tokens=2), f"r{i}"):
                pass
            cached.append(out.num_cached_tokens)
        return cached

    loop = asyncio.new_event_loop()
    engine = AsyncLLM.from_model(str(llama_dir), num_kv_blocks=64, max_model_len=256, block_size=8)
    try:
        cached = loop.run_until_complete(go(engine))
    finally:
        engine.shutdown()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
    assert calls == [] and cached == [0, 32]
