"""Preemption that a policy asks for mid-step: outputs stay those of the solo run, the prefix
cache never holds a block nobody wrote, and no policy can keep the engine from progressing."""

from __future__ import annotations

import pytest

from pagelm import LLM, SamplingParams, hookimpl
from pagelm.config import EngineConfig
from pagelm.kv_cache import KVCacheManager, make_block_hasher
from pagelm.plugin_manager import get_plugin_manager
from pagelm.plugins.policies.fcfs import FCFSPolicy
from pagelm.plugins.policies.priority import PriorityPolicy
from pagelm.registry import PluginError
from pagelm.request import Request
from pagelm.sched.scheduler import Scheduler
from pagelm.worker.output import ModelRunnerOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [(i * 7 + 3) % 500 + 5 for i in range(100)]


def _solo(llama_dir, prompt, params=GREEDY) -> list[int]:
    llm = LLM(str(llama_dir), device="cpu", enable_prefix_caching=False)
    return list(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids)


def _drain(engine, max_steps: int = 2000) -> dict[str, list[int]]:
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    raise AssertionError(f"the engine did not finish in {max_steps} steps")


@pytest.mark.parametrize("k", range(1, 8))
def test_request_preempted_mid_prefill_by_a_more_urgent_one_keeps_its_solo_tokens(llama_dir, k):
    """Issue 23's reproduction: a 100-token prompt prefilled 16 tokens a step, preempted after
    k steps by a higher-priority arrival. Before the fix the chunk booked in the preempting
    step stayed in the prefix cache unwritten, and both this request and a later one with
    the same prompt read it back as a hit."""
    solo = _solo(llama_dir, PROMPT)
    llm = LLM(
        str(llama_dir), device="cpu", max_num_seqs=1, long_prefill_token_threshold=16,
        scheduling_policy="priority", num_kv_blocks=64,
    )
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": PROMPT}, GREEDY, priority=1)
    for _ in range(k):
        engine.step()
    engine.add_request("b", {"prompt_token_ids": [11, 12, 13, 14]}, GREEDY, priority=0)
    outputs = _drain(engine)
    assert engine.core.scheduler.num_preemptions == 1
    assert outputs["a"] == solo
    again = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0]
    assert list(again.outputs[0].token_ids) == solo
    assert again.num_cached_tokens > 0  # it did read the cache


def _prompt_logprobs(out) -> list[float | None]:
    return [None if e is None else e[t].logprob for e, t in zip(out.prompt_logprobs, out.prompt_token_ids)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_prompt_logprobs_of_a_request_recomputed_mid_prefill_equal_the_unpreempted_run(
    llama_dir, k, async_scheduling, mode
):
    """A 40-token prompt with prompt_logprobs, prefilled in chunks of 8 from a 12-block pool,
    preempted after k chunks by a higher-priority arrival: recomputed from the start, the
    positions its first chunks scored are not reported a second time (before the fix they
    were: 48 entries after one chunk); swapped, it goes on where it stopped."""
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2, ignore_eos=True)
    prompt = PROMPT[:40]
    whole = LLM(str(llama_dir), device="cpu", dtype="float32", enable_prefix_caching=False)
    expected = _prompt_logprobs(whole.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0])
    llm = LLM(
        str(llama_dir), device="cpu", dtype="float32", block_size=4, num_kv_blocks=12, max_model_len=48,
        max_num_seqs=1, max_num_batched_tokens=16, long_prefill_token_threshold=8, scheduling_policy="priority",
        preemption_mode=mode, async_scheduling=async_scheduling, num_cpu_blocks=16 if mode == "swap" else 0,
    )
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": prompt}, params, priority=1)
    finals = {}
    for _ in range(k):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    engine.add_request("b", {"prompt_token_ids": [11, 12, 13, 14]}, GREEDY, priority=0)
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.core.scheduler.num_preemptions == 1
    assert len(finals["a"].prompt_logprobs) == len(prompt)
    got = _prompt_logprobs(finals["a"])
    assert got[0] is None and got[1:] == pytest.approx(expected[1:], abs=1e-5)


# ---- the scheduler and KV cache manager alone (hand-made model outputs) --------------------
BS = 4


def _scheduler(policy_cls=PriorityPolicy, num_blocks=64, **kw) -> Scheduler:
    config = EngineConfig(model="unused", block_size=BS, **kw)
    kv = KVCacheManager(num_blocks, BS, config.enable_prefix_caching)
    return Scheduler(config, kv, policy_cls(config), max_model_len=1024)


def _request(req_id: str, prompt: list[int], priority: int = 0) -> Request:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    return Request(req_id, prompt, params, priority=priority, block_hasher=make_block_hasher(BS))


def _step(sched: Scheduler):
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sched.update_from_output(out, ModelRunnerOutput(ids, [[7] for _ in ids]))
    return out


def _cached_block_ids(sched: Scheduler) -> set[int]:
    return {b.block_id for b in sched.kv.pool.cached_blocks.values()}


def test_chunk_booked_in_the_preempting_step_leaves_the_prefix_cache():
    sched = _scheduler(max_num_seqs=1, long_prefill_token_threshold=8)
    sched.add_request(_request("long", list(range(100, 140)), priority=1))
    _step(sched)  # 8 tokens computed: blocks 0-1 written and cached
    written = set(sched.kv.get_block_ids("long"))
    sched.add_request(_request("urgent", [1, 2, 3], priority=0))
    out = sched.schedule()  # books long's next chunk (blocks 2-3), then preempts long for urgent
    assert out.preempted_req_ids == {"long"} and "long" not in out.num_scheduled_tokens
    assert _cached_block_ids(sched) == written


def test_request_admitted_on_a_hit_of_a_block_that_will_not_be_written_gives_way_too():
    """``a`` books a chunk filling block 1; ``b`` (same prefix) is admitted in the same step on
    a hit of it; then ``a`` is preempted for ``c``: nobody writes block 1, so ``b`` gives way."""

    class VictimA(FCFSPolicy):
        def select_victim_for(self, request, running):
            return next((r for r in running if r.request_id == "a"), None) if request.request_id == "c" else None

    sched = _scheduler(VictimA, max_num_seqs=2, long_prefill_token_threshold=4, max_num_partial_prefills=2)
    shared = list(range(200, 212))
    sched.add_request(_request("a", shared + [1]))
    _step(sched)  # a: block 0 written
    sched.add_request(_request("b", shared + [2]))
    sched.add_request(_request("c", [9, 9, 9]))
    out = sched.schedule()
    assert out.preempted_req_ids == {"a", "b"}
    assert "b" not in out.num_scheduled_tokens
    block_0 = sched.kv.pool.get_cached_block(sched.requests["a"].block_hashes[0])
    assert _cached_block_ids(sched) == {block_0.block_id}
    sched.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), []))
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        _step(sched)
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


# ---- progress whatever the policy ------------------------------------------------------------
class PingPongPolicy(FCFSPolicy):
    """Always preempts the running request for the waiting one: without the scheduler's
    progress guard two requests displace each other forever."""

    name = "ping_pong"

    def select_victim_for(self, request, running):
        return running[0] if running else None


class _PingPongPlugin:
    @hookimpl
    def pagelm_register_scheduling_policies(self, registry) -> None:
        registry.add(PingPongPolicy.name, PingPongPolicy)


@pytest.fixture
def ping_pong():
    get_plugin_manager().register(_PingPongPlugin(), name="test-ping-pong")
    yield
    get_plugin_manager().unregister(name="test-ping-pong")


def test_a_policy_that_always_preempts_cannot_stall_the_engine(llama_dir, ping_pong):
    prompts = [PROMPT[:60], PROMPT[40:]]
    solo = [_solo(llama_dir, p) for p in prompts]
    llm = LLM(
        str(llama_dir), device="cpu", max_num_seqs=1, long_prefill_token_threshold=16,
        enable_prefix_caching=False, scheduling_policy="ping_pong", max_stalled_preemptions=3,
    )
    for i, p in enumerate(prompts):
        llm.engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    outputs = _drain(llm.engine, max_steps=500)
    assert [outputs["0"], outputs["1"]] == solo
    # The first to give way 3 times is kept running to the end, then the other runs alone.
    assert 3 <= llm.engine.core.scheduler.num_preemptions <= 6
    kv = llm.engine.core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_a_victim_that_is_not_running_is_an_error_naming_the_policy():
    class Confused(FCFSPolicy):
        def select_victim_for(self, request, running):
            return request  # the waiting request itself, not a running one

    sched = _scheduler(Confused, max_num_seqs=1)
    sched.add_request(_request("a", [1, 2, 3]))
    _step(sched)
    sched.add_request(_request("b", [4, 5, 6]))
    with pytest.raises(PluginError, match=r"scheduling_policy='fcfs' \(test_preemption_regressions\..*Confused\) chose a victim that is not running"):
        sched.schedule()
