"""The CPU tier of the KV cache (``swap_space`` / ``num_cpu_blocks``): swap preemption and
prefix spill give the plain run's greedy tokens, a prefix hit in the tier computes fewer
tokens, and both pools' books balance after every step of random add/abort/step runs."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagelm import LLM, SamplingParams, hookimpl
from pagelm.config import EngineConfig
from pagelm.engine.core_loop import SchedulerStats
from pagelm.kv_cache import BlockPool, KVCacheManager, cdiv, make_block_hasher
from pagelm.plugin_manager import get_plugin_manager
from pagelm.plugins.kv_offload import CPUOffload
from pagelm.plugins.kv_offload.cost import SwapCost
from pagelm.plugins.kv_offload.tier import CPUTier
from pagelm.plugins.policies.fcfs import FCFSPolicy
from pagelm.request import Request, RequestStatus
from pagelm.sched.scheduler import Scheduler
from pagelm.worker.output import ModelRunnerOutput

BS = 4
MAX_MODEL_LEN = 96
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 200 + 5 for j in range(26 + 6 * i)] for i in range(6)]


def generate(llama_dir, prompts=PROMPTS, params=GREEDY, **kw):
    """(token ids per prompt, the engine core) of one LLM run."""
    llm = LLM(str(llama_dir), device="cpu", max_model_len=MAX_MODEL_LEN, block_size=BS, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm.engine.core


@pytest.fixture(scope="module")
def plain(llama_dir):
    return generate(llama_dir, enable_prefix_caching=False)[0]


# ---- outputs -------------------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-prefill"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_swap_and_recompute_preemption_give_the_unpreempted_tokens(llama_dir, plain, chunked, async_scheduling):
    chunking = dict(max_num_batched_tokens=16, long_prefill_token_threshold=8) if chunked else {}
    tight = dict(num_kv_blocks=30, async_scheduling=async_scheduling, **chunking)
    recomputed, core_r = generate(llama_dir, preemption_mode="recompute", **tight)
    swapped, core_s = generate(llama_dir, num_cpu_blocks=128, preemption_mode="swap", **tight)
    assert recomputed == plain and swapped == plain
    assert core_r.scheduler.num_preemptions > 0
    stats = core_s.kv_cache_manager.offload.stats()
    assert stats.num_swap_preemptions == core_s.scheduler.num_preemptions > 0
    assert stats.blocks_swapped_in > 0
    for core in (core_r, core_s):
        assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks
    assert stats.num_free_blocks == stats.num_blocks


def test_swap_without_prefix_caching_gives_the_unpreempted_tokens(llama_dir, plain):
    got, core = generate(
        llama_dir, num_kv_blocks=30, num_cpu_blocks=128, preemption_mode="swap", enable_prefix_caching=False
    )
    assert got == plain
    assert core.kv_cache_manager.offload.stats().num_swap_preemptions > 0


def test_a_full_tier_falls_back_to_recompute(llama_dir, plain):
    got, core = generate(llama_dir, num_kv_blocks=30, num_cpu_blocks=2, preemption_mode="swap",
                         enable_prefix_caching=False)
    assert got == plain
    stats = core.kv_cache_manager.offload.stats()
    assert core.scheduler.num_preemptions > stats.num_swap_preemptions


def test_prefix_spilled_to_the_tier_is_hit_and_computes_fewer_tokens(llama_dir):
    """A long prefix, then enough other prompts to evict it from a small GPU pool, then the
    prefix again: with the tier its blocks come back from host memory."""
    prefix = [(5 * j) % 97 + 3 for j in range(40)]
    fillers = [[(11 * i + j) % 150 + 50 for j in range(60)] for i in range(3)]
    probe = prefix + [9, 8, 7, 6, 5]

    def run(**kw):
        llm = LLM(str(llama_dir), device="cpu", max_model_len=MAX_MODEL_LEN, block_size=BS, num_kv_blocks=40, **kw)
        for prompts in ([prefix], fillers, [probe]):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        return list(outs[0].outputs[0].token_ids), outs[0].num_cached_tokens, llm.engine.core

    without, cached_without, _ = run()
    with_tier, cached_with, core = run(num_cpu_blocks=64)
    assert with_tier == without
    assert cached_without == 0  # the fillers evicted every block of the prefix
    assert cached_with == len(prefix)  # all 10 prefix blocks came back from the tier
    assert core.kv_cache_manager.offload.stats().hit_blocks == len(prefix) // BS


def test_auto_mode_swaps_where_copying_is_cheaper():
    cost = SwapCost(block_bytes=2 * 2**20, flops_per_token=16e9, copy_bytes_per_s=25e9, device_flops=300e12)
    # 8B model on an H100: 16 tokens' KV (one 2 MiB block) copies in ~0.17 ms out and back,
    # recomputing them takes ~0.85 ms.
    assert cost.swap_is_cheaper(num_copy_blocks=1, num_recompute_tokens=16)
    # The prefix cache still holds most of it: recomputing 2 tokens is cheaper.
    assert not cost.swap_is_cheaper(num_copy_blocks=10, num_recompute_tokens=2)


def test_bad_preemption_mode_and_swap_without_tier_are_clear_errors():
    with pytest.raises(ValueError, match=r"preemption_mode must be 'auto', 'swap' or 'recompute', got 'lazy'"):
        EngineConfig(model="m", preemption_mode="lazy")
    with pytest.raises(ValueError, match=r"preemption_mode='swap' needs a CPU tier: set swap_space"):
        EngineConfig(model="m", preemption_mode="swap")
    with pytest.raises(ValueError, match=r"swap_space must be >= 0 GiB"):
        EngineConfig(model="m", swap_space=-1)


def test_unknown_tier_name_lists_the_registered_ones(llama_dir):
    with pytest.raises(ValueError, match=r"unknown kv offload 'nvme'; registered: cpu"):
        LLM(str(llama_dir), device="cpu", num_cpu_blocks=8, kv_offload="nvme")


def test_swap_space_sizes_the_tier_in_gib(llama_dir):
    _, core = generate(llama_dir, prompts=PROMPTS[:1], swap_space=0.001)
    block_bytes = core.kv_cache_manager.offload.stats().block_bytes
    assert core.num_cpu_blocks == int(0.001 * 2**30 // block_bytes) > 0
    assert core.runner.kv_copier.cpu_cache.shape[0] == core.num_cpu_blocks


def test_no_tier_means_no_transfers_and_no_copier(llama_dir):
    _, core = generate(llama_dir, prompts=PROMPTS[:2], num_kv_blocks=30)
    assert core.kv_cache_manager.offload is None and core.runner.kv_copier is None
    assert core.scheduler.schedule().kv_transfers is None


class CountingOffload(CPUOffload):
    """The built-in tier under another name, recording what the engine made it with."""

    name = "counting_cpu"
    made: list[tuple[int, int, float]] = []

    @classmethod
    def make_tier(cls, config, num_blocks, block_bytes, flops_per_token):
        cls.made.append((num_blocks, block_bytes, flops_per_token))
        return super().make_tier(config, num_blocks, block_bytes, flops_per_token)


class _CountingPlugin:
    @hookimpl
    def pagelm_register_kv_offload(self, registry) -> None:
        registry.add(CountingOffload.name, CountingOffload)


def test_hook_pagelm_register_kv_offload(llama_dir, plain):
    get_plugin_manager().register(_CountingPlugin(), name="test-counting-offload")
    try:
        got, core = generate(llama_dir, num_kv_blocks=30, num_cpu_blocks=48, kv_offload="counting_cpu",
                             preemption_mode="swap", enable_prefix_caching=False)
    finally:
        get_plugin_manager().unregister(name="test-counting-offload")
    assert got == plain
    block_bytes = sum(c.numel() * c.element_size() for c in core.runner.kv_caches) // 30
    num_params = sum(p.numel() for p in core.runner.model.parameters())
    assert CountingOffload.made == [(48, block_bytes, 2.0 * num_params)]
    assert core.kv_cache_manager.offload.stats().num_swap_preemptions > 0
    assert SchedulerStats.of(core).kv_offload.blocks_swapped_in > 0  # what the metrics read


def test_swap_under_tensor_parallelism_gives_the_one_rank_tokens(llama_dir, plain):
    """Each rank holds its slice of the tier; the copies reach rank 1 with the step."""
    llm = LLM(str(llama_dir), device="cpu", max_model_len=MAX_MODEL_LEN, block_size=BS, num_kv_blocks=30,
              num_cpu_blocks=64, preemption_mode="swap", tensor_parallel_size=2)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        stats = llm.engine.core.kv_cache_manager.offload.stats()
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == plain
    assert stats.num_swap_preemptions > 0 and stats.blocks_swapped_in > 0


# ---- aborts ----------------------------------------------------------------------------------


def test_abort_of_a_swapped_out_request_frees_both_tiers(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", max_model_len=MAX_MODEL_LEN, block_size=BS, num_kv_blocks=30,
              num_cpu_blocks=64, preemption_mode="swap")
    engine, core = llm.engine, llm.engine.core
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    tier = core.kv_cache_manager.offload
    for _ in range(200):
        engine.step()
        if tier.swapped:
            break
    victim = next(iter(tier.swapped))
    assert core.scheduler.requests[victim].status == RequestStatus.PREEMPTED
    engine.abort_request([victim])
    assert victim not in tier.swapped
    for _ in range(400):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks
    assert tier.num_free_blocks == tier.pool.num_blocks


def test_abort_right_after_the_swap_out_step_frees_both_tiers(llama_dir):
    """Aborted with its swap-out copies just queued (mid-swap), then more steps reuse both pools."""
    llm = LLM(str(llama_dir), device="cpu", max_model_len=MAX_MODEL_LEN, block_size=BS, num_kv_blocks=30,
              num_cpu_blocks=64, preemption_mode="swap", async_scheduling=True)
    engine, core = llm.engine, llm.engine.core
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    tier = core.kv_cache_manager.offload
    aborted = set()
    for _ in range(400):
        before = set(tier.swapped)
        engine.step()
        new = set(tier.swapped) - before
        if new:
            engine.abort_request(sorted(new))
            aborted |= new
        if not engine.has_unfinished_requests():
            break
    assert aborted
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks
    assert tier.num_free_blocks == tier.pool.num_blocks and not tier.swapped


# ---- the tier's ordering rules within one step -----------------------------------------------


def _tier(num_blocks: int) -> CPUTier:
    return CPUTier(num_blocks, BS, 1024, SwapCost(1024, 1e6, 1e9, 1e9))


def _request(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=4), block_hasher=make_block_hasher(BS))


def test_a_spill_never_evicts_the_tier_block_a_load_reads_in_the_same_step():
    tier, req = _tier(2), _request("a", list(range(9)))
    h1, h2 = req.block_hashes
    tier.spill(5, h1)
    tier.spill(6, h2)
    tier.take_transfers()
    h1_block = tier.pool.get_cached_block(h1)
    tier.load(req, 0, [10])  # reads h1's tier block this step (the LRU one)
    tier.spill(7, b"another prefix block")  # needs a tier block: evicts h2's, not h1's
    transfers = tier.take_transfers()
    assert transfers.swap_in == [(h1_block.block_id, 10)]
    assert transfers.swap_out == [(7, tier.pool.get_cached_block(b"another prefix block").block_id)]
    assert transfers.swap_out[0][1] != h1_block.block_id
    assert tier.count_hits([h1, h2]) == 1 and tier.num_free_blocks == 1
    # Until the runner reports the load landed, its source stays held: a later step's spill
    # evicts the other block, never the one being read.
    other = transfers.swap_out[0][1]
    tier.spill(8, b"a third prefix block")
    assert tier.take_transfers().swap_out == [(8, other)] and tier.pool.get_cached_block(h1) is h1_block
    tier.loads_landed(["a"])
    assert tier.num_free_blocks == 2


def test_a_block_evicted_then_reused_as_a_load_target_in_one_step_is_still_spilled():
    # GPU block 5 held h2 and is evicted for reuse (spill queued); later in the same step a
    # load of h1 takes block 5 as its target. h2's KV is still in block 5 when the step's
    # copies run (swap-outs before swap-ins): it must reach the tier, or a later turn misses it.
    tier, req = _tier(4), _request("a", list(range(9)))
    h1, h2 = req.block_hashes
    tier.spill(3, h1)
    tier.take_transfers()
    h1_block = tier.pool.get_cached_block(h1)
    tier.spill(5, h2)
    tier.load(req, 0, [5])
    transfers = tier.take_transfers()
    assert transfers.swap_out == [(5, tier.pool.get_cached_block(h2).block_id)]
    assert transfers.swap_in == [(h1_block.block_id, 5)]
    assert tier.count_hits([h1, h2]) == 2


def test_a_block_loaded_then_evicted_in_one_step_is_not_spilled():
    # The reverse order: block 5 is a load's target, then evicted in the same step (its
    # request gave way): its KV is not there yet, so nothing is copied out of it.
    tier, req = _tier(4), _request("a", list(range(9)))
    h1, h2 = req.block_hashes
    tier.spill(3, h1)
    tier.take_transfers()
    tier.load(req, 0, [5])
    tier.spill(5, h1)
    transfers = tier.take_transfers()
    assert transfers.swap_out == [] and len(transfers.swap_in) == 1


def test_a_block_loaded_and_swapped_out_again_in_one_step_is_shared_not_copied():
    tier = _tier(4)
    gpu = BlockPool(8)
    req = _request("a", list(range(7)))
    first = gpu.get_new_blocks(2)
    assert tier.swap_out("a", first, 7, force=True)
    swapped_blocks = list(tier.swapped["a"][0])
    assert len(tier.take_transfers().swap_out) == 2
    again = gpu.get_new_blocks(2)
    tier.load(req, 0, [b.block_id for b in again])  # resumed...
    assert tier.swap_out("a", again, 7, force=True)  # ...and preempted again before its copy ran
    transfers = tier.take_transfers()
    assert transfers.swap_out == [] and len(transfers.swap_in) == 2
    assert tier.swapped["a"][0] == swapped_blocks  # the same tier blocks, still holding its KV
    assert tier.num_free_blocks == 2
    tier.free("a")
    assert tier.num_free_blocks == 2  # the load in flight still reads them
    tier.loads_landed(["a"])
    assert tier.num_free_blocks == 4


# ---- both pools' books, step by step ---------------------------------------------------------


def check_invariants(sched: Scheduler) -> None:
    """Every block of both pools is free or held, reference counts equal the holders, the
    free queues hold exactly the unreferenced blocks, hash maps point at blocks carrying
    that hash, and a swapped request is a preempted one whose tokens its blocks cover."""
    kv, tier = sched.kv, sched.kv.offload
    gpu_holders = [b for blocks in kv.req_to_blocks.values() for b in blocks]
    tier_holders = [b for blocks, _ in tier.swapped.values() for b in blocks]
    tier_holders += [b for blocks in tier._load_sources.values() for b in blocks]  # loads not landed
    for pool, holders in ((kv.pool, gpu_holders), (tier.pool, tier_holders)):
        counts: dict[int, int] = {}
        for b in holders:
            counts[b.block_id] = counts.get(b.block_id, 0) + 1
        free = {b.block_id for b in pool.free_queue}
        assert len(free) == pool.num_free_blocks
        for b in pool.blocks:
            assert b.ref_cnt == counts.get(b.block_id, 0), f"{b}: {counts.get(b.block_id, 0)} holders"
            assert (b.ref_cnt == 0) == (b.block_id in free), f"{b} free={b.block_id in free}"
        for block_hash, b in pool.cached_blocks.items():
            assert b.block_hash == block_hash
    assert not tier._loading and not tier._spills  # settled by take_transfers
    for req_id, (blocks, num_tokens) in tier.swapped.items():
        req = sched.requests[req_id]
        assert req.status == RequestStatus.PREEMPTED and req_id not in kv.req_to_blocks
        assert req.num_computed_tokens == 0 and len(blocks) == cdiv(num_tokens, BS)
        assert num_tokens < req.num_tokens  # at least one token left to compute when it is back


def make_scheduler(num_blocks: int, num_cpu_blocks: int, mode: str, caching: bool, max_tokens: int) -> Scheduler:
    config = EngineConfig(model="unused", block_size=BS, max_num_batched_tokens=max_tokens,
                          long_prefill_token_threshold=8, enable_prefix_caching=caching,
                          num_cpu_blocks=num_cpu_blocks, preemption_mode=mode)
    cost = SwapCost(block_bytes=1024, flops_per_token=1e6, copy_bytes_per_s=1e9, device_flops=1e9)
    tier = CPUTier(num_cpu_blocks, BS, 1024, cost)
    kv = KVCacheManager(num_blocks, BS, caching, offload=tier)
    return Scheduler(config, kv, FCFSPolicy(config), max_model_len=64)


op_st = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 2), st.integers(1, 30), st.integers(1, 16)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    ops=st.lists(op_st, min_size=5, max_size=40),
    num_blocks=st.integers(16, 28),
    num_cpu_blocks=st.integers(0, 40),
    mode=st.sampled_from(["swap", "auto", "recompute"]),
    caching=st.booleans(),
    max_tokens=st.sampled_from([8, 32]),
    load_delay=st.integers(0, 2),
)
def test_random_add_abort_step_keeps_both_pools_consistent(ops, num_blocks, num_cpu_blocks, mode, caching, max_tokens, load_delay):
    sched = make_scheduler(num_blocks, max(num_cpu_blocks, 1), mode, caching, max_tokens)
    prefixes = [[], list(range(100, 112)), list(range(200, 209))]
    hasher = make_block_hasher(BS)
    added = 0
    # Loads land ``load_delay`` steps after the step that queued them (a slow copy): the
    # requests wait admitted, holding their blocks, and may be aborted meanwhile.
    in_flight_loads: list[list[str]] = [[] for _ in range(load_delay)]

    def step():
        out = sched.schedule()
        check_invariants(sched)
        req_ids = list(out.num_scheduled_tokens)
        in_flight_loads.append([r for r, _ in out.kv_transfers.loads] if out.kv_transfers else [])
        landed = in_flight_loads.pop(0)
        sched.update_from_output(out, ModelRunnerOutput(req_ids, [[7] for _ in req_ids], finished_loads=landed))
        check_invariants(sched)

    for op in ops:
        if op[0] == "add":
            _, prefix, tail, max_new = op
            prompt = prefixes[prefix] + [(added * 13 + j) % 90 + 1 for j in range(tail)]
            sp = SamplingParams(max_tokens=max_new, ignore_eos=True)
            sched.add_request(Request(str(added), prompt, sp, block_hasher=hasher))
            added += 1
        elif op[0] == "abort":
            sched.finish_requests([str(op[1])], RequestStatus.FINISHED_ABORTED)
            check_invariants(sched)
        else:
            for _ in range(op[1]):
                step()
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        step()
    assert not sched.has_unfinished_requests() and not any(in_flight_loads)
    sched.schedule()  # settles the last step's copies
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.kv.offload.num_free_blocks == sched.kv.offload.pool.num_blocks


# ---- CUDA: pinned host tier, copies on a side stream -----------------------------------------


@pytest.mark.gpu
def test_swap_and_spill_on_cuda_give_the_unpreempted_tokens_without_host_syncs(llama_dir):
    """CUDA graphs and async scheduling on: swap-outs and spills overlap the forward pass on
    the side stream, swap-ins are waited for on the device, and no copy syncs the host."""
    from cuda_helpers import forbid_host_sync

    args = dict(device="cuda", dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=BS)
    llm = LLM(str(llama_dir), num_kv_blocks=512, **args)
    plain = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
    del llm
    llm = LLM(str(llama_dir), num_kv_blocks=30, num_cpu_blocks=256, preemption_mode="swap", **args)
    core = llm.engine.core
    assert core.async_scheduling and core.runner.kv_copier.cpu_cache.is_pinned()
    with forbid_host_sync():
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == plain
    stats = core.kv_cache_manager.offload.stats()
    assert stats.num_swap_preemptions > 0 and stats.blocks_swapped_in > 0
    # The prompts again: their prefixes were spilled as the pool turned over.
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in again] == plain
    assert core.kv_cache_manager.offload.stats().hit_blocks > stats.hit_blocks


# ---- pagelm bench offload ---------------------------------------------------------------------


def test_bench_offload_chat_reports_a_higher_prefix_hit_rate_with_the_tier(llama_dir, tmp_path):
    import json

    from pagelm.cli import main

    out = tmp_path / "chat.json"
    assert main(["bench", "offload", "--model", str(llama_dir), "--workload", "chat", "--conversations", "4",
                 "--turns", "2", "--concurrency", "1", "--user-len", "12", "--reply-len", "2", "--device", "cpu",
                 "--block-size", str(BS), "--max-model-len", "32", "--json", str(out)]) == 0
    without, with_tier = json.loads(out.read_text())["results"]
    assert (without["run"], with_tier["run"]) == ("no tier", "cpu tier")
    assert with_tier["prefix_hit_rate"] > without["prefix_hit_rate"]
    assert with_tier["tier_hit_blocks"] > 0 == without["tier_hit_blocks"]


@pytest.mark.parametrize("block_dim", [0, 1], ids=["blocks-first", "kv-first"])
def test_copier_batches_and_runs_move_every_layer_block_exactly(block_dim, monkeypatch):
    """The copier stages a few blocks at a time (here 3: runs of consecutive tier blocks get
    split across batches) and copies all layers of a run at once: swapping blocks out, wiping
    the GPU cache, and swapping them into other GPU blocks gives every layer's KV back."""
    import torch

    import pagelm.plugins.kv_offload.copier as copier_mod
    from pagelm.kv_offload import KVTransfers

    shape = [10, 3, 4, 5] if block_dim == 0 else [2, 10, 4, 5]  # 10 blocks: first, or after K/V
    caches = [torch.randn(shape) for _ in range(3)]
    block = caches[0].select(block_dim, 0)
    monkeypatch.setattr(copier_mod, "STAGING_BYTES", 3 * len(caches) * block.numel() * block.element_size())
    copier = copier_mod.CPUCopier(12, caches, block_dim)
    assert copier.blocks_per_batch == 3 and copier.cpu_cache.shape[:2] == (12, 3)
    gpu_blocks, tier_blocks = [7, 1, 2, 3, 9, 0, 4], [0, 1, 2, 3, 4, 8, 10]  # runs 0-4 and 8, 10 alone
    want = [c.index_select(block_dim, torch.tensor(gpu_blocks)).clone() for c in caches]

    class Step:
        def __init__(self, transfers):
            self.kv_transfers = transfers

    copier.before_step(Step(KVTransfers(swap_out=list(zip(gpu_blocks, tier_blocks)))))
    for c in caches:
        c.zero_()
    back = [5, 6, 8, 0, 1, 2, 3]
    copier.before_step(Step(KVTransfers(swap_in=list(zip(tier_blocks, back)))))
    for c, w in zip(caches, want):
        assert torch.equal(c.index_select(block_dim, torch.tensor(back)), w)
    untouched = sorted(set(range(10)) - set(back))
    assert all(c.index_select(block_dim, torch.tensor(untouched)).abs().sum() == 0 for c in caches)
