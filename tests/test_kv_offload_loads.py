"""Asynchronous loads from the CPU tier (plugin API 2.18): a request whose KV is in the tier is
admitted, its blocks are copied back behind the other requests' steps, and it is scheduled
only once the runner reports its load landed. Outputs equal the plain run however late the
loads land; aborts and preemptions around a load leave both pools' books balanced."""

from __future__ import annotations

import random

import pytest

from pagelm import LLM, SamplingParams, hookimpl
from pagelm.plugin_manager import get_plugin_manager
from pagelm.plugins.kv_offload import CPUOffload
from pagelm.plugins.kv_offload.copier import CPUCopier
from pagelm.request import Request, RequestStatus
from pagelm.worker.output import ModelRunnerOutput
from pagelm.kv_cache import make_block_hasher

from test_kv_offload import BS, GREEDY, MAX_MODEL_LEN, PROMPTS, check_invariants, generate, make_scheduler


# ---- the engine, with loads that land late ---------------------------------------------------


class SlowCopier(CPUCopier):
    """The CPU copier, whose copies are done when queued, reporting each load only after
    ``delay`` more reports (a slow PCIe link); a step with nothing else to do gets the
    oldest at once, as a waiting CUDA copier would."""

    delay = 2

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held: list[tuple[str, int]] = []  # (req_id, reports left)
        self.steps_while_loading = 0  # reports that found a load still held

    def finished_loads(self, wait: bool) -> list[str]:
        self.held += [(r, self.delay) for r in super().finished_loads(wait=False)]
        if self.held:
            self.steps_while_loading += 1
        self.held = [(r, n - 1) for r, n in self.held]
        if wait and self.held and all(n > 0 for _, n in self.held):
            self.held[0] = (self.held[0][0], 0)
        done = [r for r, n in self.held if n <= 0]
        self.held = [(r, n) for r, n in self.held if n > 0]
        return done


class SlowOffload(CPUOffload):
    name = "slow_cpu"

    @classmethod
    def make_copier(cls, config, num_blocks, kv_caches, block_dim):
        return SlowCopier(num_blocks, kv_caches, block_dim)


class _SlowPlugin:
    @hookimpl
    def pagelm_register_kv_offload(self, registry) -> None:
        registry.add(SlowOffload.name, SlowOffload)


@pytest.fixture
def slow_tier():
    get_plugin_manager().register(_SlowPlugin(), name="test-slow-offload")
    yield
    get_plugin_manager().unregister(name="test-slow-offload")


@pytest.fixture(scope="module")
def plain(llama_dir):
    return generate(llama_dir, enable_prefix_caching=False)[0]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_swap_with_loads_landing_late_gives_the_unpreempted_tokens(llama_dir, plain, slow_tier, async_scheduling):
    got, core = generate(llama_dir, num_kv_blocks=30, num_cpu_blocks=128, preemption_mode="swap",
                         kv_offload="slow_cpu", async_scheduling=async_scheduling)
    assert got == plain
    stats = core.kv_cache_manager.offload.stats()
    assert stats.num_swap_preemptions > 0 and stats.blocks_swapped_in > 0
    assert core.runner.kv_copier.steps_while_loading > 0  # other requests ran while loads were held
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks
    assert stats.num_free_blocks == stats.num_blocks


def chat(llm: LLM, num_conversations: int, num_turns: int, max_tokens: int, seed: int) -> list[list[int]]:
    """Each turn of every conversation sent after the previous turn's answers, the whole
    conversation so far as the prompt: by the time a conversation comes back the others may
    have pushed its prefix out of a small GPU pool. Returns every answer, in order."""
    rng = random.Random(seed)
    turns = [[[rng.randrange(5, 250) for _ in range(12)] for _ in range(num_turns)] for _ in range(num_conversations)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    history, replies = [[] for _ in turns], []
    for t in range(num_turns):
        for c, conv in enumerate(turns):
            history[c] += conv[t]
        outs = llm.generate([{"prompt_token_ids": list(h)} for h in history], params, use_tqdm=False)
        for c, o in enumerate(outs):
            history[c] += list(o.outputs[0].token_ids)
            replies.append(list(o.outputs[0].token_ids))
    return replies


def test_prefix_hits_in_the_tier_landing_late_give_the_plain_tokens(llama_dir, slow_tier):
    """Conversations whose earlier turns left the GPU pool: their prefixes come back from the
    tier, late, while other conversations' turns run."""
    args = dict(device="cpu", max_model_len=MAX_MODEL_LEN, block_size=BS)
    plain_replies = chat(LLM(str(llama_dir), enable_prefix_caching=False, **args), 4, 3, 4, seed=0)
    llm = LLM(str(llama_dir), num_kv_blocks=24, num_cpu_blocks=96, kv_offload="slow_cpu", **args)
    assert chat(llm, 4, 3, 4, seed=0) == plain_replies
    core = llm.engine.core
    assert core.kv_cache_manager.offload.stats().hit_blocks > 0
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks


def test_abort_while_loading_frees_both_tiers_and_the_rest_finish(llama_dir, plain, slow_tier):
    llm = LLM(str(llama_dir), device="cpu", max_model_len=MAX_MODEL_LEN, block_size=BS, num_kv_blocks=30,
              num_cpu_blocks=64, preemption_mode="swap", kv_offload="slow_cpu")
    engine, core = llm.engine, llm.engine.core
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    sched, aborted, tokens = core.scheduler, set(), {}
    for _ in range(400):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        loading = [r for r, req in sched.requests.items() if req.status == RequestStatus.WAITING_FOR_KV]
        if loading and not aborted:
            engine.abort_request(loading[:1])
            aborted.add(loading[0])
        if not engine.has_unfinished_requests():
            break
    assert aborted and not engine.has_unfinished_requests()
    for i, want in enumerate(plain):
        if str(i) not in aborted:
            assert tokens[str(i)] == want
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks
    tier = core.kv_cache_manager.offload
    assert tier.num_free_blocks == tier.pool.num_blocks and not tier.swapped


# ---- the scheduler alone: random arrivals, aborts, preemptions and load delays ----------------


def test_a_request_hitting_a_prefix_still_loading_waits_for_it():
    """The second request's prefix is the first one's, loaded from the tier this step: it is
    admitted only after the load is reported, and that step names the load in ``waits``."""
    sched = make_scheduler(num_blocks=24, num_cpu_blocks=16, mode="swap", caching=True, max_tokens=32)
    hasher = make_block_hasher(BS)
    prefix = list(range(100, 116))  # 4 blocks
    first = Request("a", prefix + [1, 2], SamplingParams(max_tokens=1, ignore_eos=True), block_hasher=hasher)
    # Put the prefix in the tier only: a spilled copy, and the GPU pool forgets it.
    tier = sched.kv.offload
    blocks = sched.kv.pool.get_new_blocks(4)
    sched.kv.pool.cache_full_blocks(blocks, first.block_hashes[:4])
    for b, h in zip(blocks, first.block_hashes[:4]):
        tier.spill(b.block_id, h)
    tier.take_transfers()
    sched.kv.pool.free_blocks(blocks)
    sched.kv.pool.reset_prefix_cache()
    assert tier.count_hits(first.block_hashes[:4]) == 4

    sched.add_request(first)
    out = sched.schedule()
    assert out.kv_transfers.loads == [("a", 4)] and not out.num_scheduled_tokens
    assert first.status == RequestStatus.WAITING_FOR_KV and sched.num_waiting == 1
    second = Request("b", prefix + [3], SamplingParams(max_tokens=1, ignore_eos=True), block_hasher=hasher)
    sched.add_request(second)
    out2 = sched.schedule()
    assert not out2.num_scheduled_tokens  # "b" would hit "a"'s blocks before they hold KV
    sched.update_from_output(out, ModelRunnerOutput([], [], finished_loads=[]))
    sched.update_from_output(out2, ModelRunnerOutput([], [], finished_loads=["a"]))
    out3 = sched.schedule()
    assert out3.kv_transfers.waits == ["a"]
    assert [r.req_id for r in out3.scheduled_new_reqs] == ["a", "b"]
    assert out3.num_scheduled_tokens == {"a": 2, "b": 1}  # both on the 16 loaded tokens
    assert second.num_cached_tokens == 16


def test_a_schedule_that_raises_after_booking_a_load_leaves_no_stale_load(monkeypatch):
    """A load is booked in ``allocate_slots`` and handed out by ``take_transfers``; when
    ``schedule()`` raised between the two, the engine failed every request, yet the next
    step's transfers still named the failed request's load (into blocks by then free)."""
    sched = make_scheduler(num_blocks=24, num_cpu_blocks=16, mode="swap", caching=True, max_tokens=32)
    kv, tier, hasher = sched.kv, sched.kv.offload, make_block_hasher(BS)
    prefix = list(range(100, 116))  # 4 blocks, in the tier only
    first = Request("a", prefix + [1, 2], SamplingParams(max_tokens=1, ignore_eos=True), block_hasher=hasher)
    blocks = kv.pool.get_new_blocks(4)
    kv.pool.cache_full_blocks(blocks, first.block_hashes[:4])
    for b, h in zip(blocks, first.block_hashes[:4]):
        tier.spill(b.block_id, h)
    tier.take_transfers()
    kv.pool.free_blocks(blocks)
    kv.pool.reset_prefix_cache()

    sched.add_request(first)
    take = kv.take_transfers
    monkeypatch.setattr(kv, "take_transfers", lambda: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(RuntimeError, match="injected"):
        sched.schedule()
    monkeypatch.setattr(kv, "take_transfers", take)
    assert [r.request_id for r in sched.fail_all()] == ["a"]
    kv.reset_after_failure()  # what EngineCore.fail_all does next

    other = Request("b", [7, 8, 9], SamplingParams(max_tokens=1, ignore_eos=True), block_hasher=hasher)
    sched.add_request(other)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"b": 3}
    assert out.kv_transfers is None or not out.kv_transfers.loads
    assert tier.num_free_blocks == tier.pool.num_blocks  # the load's sources went back too
    assert kv.num_free_blocks == kv.num_blocks - len(kv.req_to_blocks["b"])


def test_random_runs_with_late_loads_keep_both_pools_consistent():
    """Long random runs (arrivals sharing prefixes, aborts aimed at loading requests, a tight
    pool, loads landing 0-3 steps late) check both pools' books after every step; together
    they start loads, wait for them and abort requests while they load."""
    totals = {"loads": 0, "aborted_loading": 0, "waits": 0}
    for seed in range(16):
        seen = _random_run(seed)
        assert seen["loads"] > 0 and seen["waits"] > 0, f"seed {seed}: {seen}"
        for k in totals:
            totals[k] += seen[k]
    assert totals["aborted_loading"] > 0, totals


def _random_run(seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    sched = make_scheduler(rng.randint(16, 24), rng.randint(8, 40), rng.choice(["swap", "auto"]),
                           rng.random() < 0.7, rng.choice([8, 32]))
    hasher = make_block_hasher(BS)
    prefixes = [list(range(100, 112)), list(range(200, 216)), []]
    in_flight: list[tuple[int, str]] = []  # (steps left, req_id)
    seen = {"loads": 0, "aborted_loading": 0, "waits": 0}

    def step():
        nonlocal in_flight
        out = sched.schedule()
        check_invariants(sched)
        if out.kv_transfers:
            seen["loads"] += len(out.kv_transfers.loads)
            seen["waits"] += len(out.kv_transfers.waits)
            in_flight += [(rng.randint(0, 3), r) for r, _ in out.kv_transfers.loads]
        landed = [r for n, r in in_flight if n == 0]
        in_flight = [(n - 1, r) for n, r in in_flight if n > 0]
        if out.is_empty and in_flight and not landed:  # nothing else to do: the oldest lands
            landed, in_flight = [in_flight[0][1]], in_flight[1:]
        req_ids = list(out.num_scheduled_tokens)
        sched.update_from_output(out, ModelRunnerOutput(req_ids, [[7] for _ in req_ids], finished_loads=landed))
        check_invariants(sched)

    for i in range(120):
        r = rng.random()
        if r < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(1, 90) for _ in range(rng.randint(1, 24))]
            sp = SamplingParams(max_tokens=rng.randint(1, 14), ignore_eos=True)
            sched.add_request(Request(str(i), prompt, sp, block_hasher=hasher))
        elif r < 0.4:
            loading = [q for q, req in sched.requests.items() if req.status == RequestStatus.WAITING_FOR_KV]
            victim = rng.choice(loading) if loading and rng.random() < 0.7 else str(rng.randrange(max(i, 1)))
            seen["aborted_loading"] += victim in loading
            sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            check_invariants(sched)
        else:
            step()
    for _ in range(3000):
        if not sched.has_unfinished_requests():
            break
        step()
    assert not sched.has_unfinished_requests(), f"seed {seed}"
    sched.schedule()  # settles the last step's copies
    assert sched.kv.num_free_blocks == sched.kv.num_blocks, f"seed {seed}"
    assert sched.kv.offload.num_free_blocks == sched.kv.offload.pool.num_blocks, f"seed {seed}"
    return seen


# ---- CUDA: loads on the side stream, reported by their events -----------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_loads_on_cuda_give_the_plain_tokens(llama_dir, async_scheduling):
    """Swap-ins and tier prefix hits copied on the side stream while other requests' steps
    run, each request scheduled once its event has fired, on the real CUDA copier."""
    args = dict(device="cuda", dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=BS,
                async_scheduling=async_scheduling)

    def run(**kw):
        llm = LLM(str(llama_dir), **args, **kw)
        replies = chat(llm, 6, 3, 6, seed=1)
        swapped = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        return replies, [list(o.outputs[0].token_ids) for o in swapped], llm.engine.core

    plain_replies, plain_swapped, _ = run(num_kv_blocks=512)
    replies, swapped, core = run(num_kv_blocks=30, num_cpu_blocks=256, preemption_mode="swap")
    assert replies == plain_replies and swapped == plain_swapped
    stats = core.kv_cache_manager.offload.stats()
    assert stats.hit_blocks > 0 and stats.num_swap_preemptions > 0
    assert not core.runner.kv_copier._pending and not core.runner.kv_copier._load_events
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks
