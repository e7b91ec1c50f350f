"""The priority and SJF policy plugins: ordering, preemption for priority, the SJF aging
bound, and the preemption-for-priority mechanism end to end through the engine."""

import zlib

import pytest

from pagelm import LLM, SamplingParams
from pagelm.config import EngineConfig
from pagelm.kv_cache import KVCacheManager, make_block_hasher
from pagelm.plugins.policies.fcfs import FCFSPolicy
from pagelm.plugins.policies.priority import PriorityPolicy
from pagelm.plugins.policies.sjf import SJFPolicy
from pagelm.request import Request, RequestStatus
from pagelm.sampling_params import SamplingParams as SP
from pagelm.sched.scheduler import Scheduler
from pagelm.worker.output import ModelRunnerOutput

BS = 4


def make_scheduler(policy_cls, num_blocks=64, plugin_config=None, **kw):
    config = EngineConfig(model="unused", block_size=BS, plugin_config=plugin_config or {}, **kw)
    kv = KVCacheManager(num_blocks, BS, config.enable_prefix_caching)
    return Scheduler(config, kv, policy_cls(config), max_model_len=1024)


def _base(req_id):
    return 1000 * (zlib.crc32(req_id.encode()) % 100_000)


def make_request(req_id, n_prompt=4, max_tokens=4, priority=0, arrival=0.0):
    return Request(
        req_id,
        list(range(_base(req_id), _base(req_id) + n_prompt)),  # distinct prompts: no prefix hits
        SP(max_tokens=max_tokens, ignore_eos=True),
        arrival_time=arrival,
        priority=priority,
        block_hasher=make_block_hasher(BS),
    )


def step(sched):
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sched.update_from_output(out, ModelRunnerOutput(ids, [[7] for _ in ids]))
    return out


def admission_order(sched, max_steps=500):
    order = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return order
        order += [r.req_id for r in step(sched).scheduled_new_reqs]
    raise AssertionError("requests did not finish")


# ---- priority -------------------------------------------------------------------------------


def test_priority_admits_lower_values_first_and_ties_by_arrival():
    sched = make_scheduler(PriorityPolicy, max_num_seqs=1)
    for req_id, prio, arrival in [("a", 2, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", 0, 3.0)]:
        sched.add_request(make_request(req_id, priority=prio, arrival=arrival))
    assert admission_order(sched) == ["b", "d", "c", "a"]


def test_high_priority_preempts_when_max_num_seqs_is_reached():
    sched = make_scheduler(PriorityPolicy, max_num_seqs=2)
    sched.add_request(make_request("lo1", max_tokens=20, priority=5, arrival=0.0))
    sched.add_request(make_request("lo2", max_tokens=20, priority=5, arrival=1.0))
    step(sched)
    sched.add_request(make_request("hi", max_tokens=20, priority=0, arrival=2.0))
    out = step(sched)
    assert out.preempted_req_ids == {"lo2"}  # the lowest-ranked: same priority, newer
    assert [r.req_id for r in out.scheduled_new_reqs] == ["hi"]
    assert set(out.num_scheduled_tokens) == {"lo1", "hi"}
    assert sched.requests["lo2"].status == RequestStatus.PREEMPTED


def test_high_priority_preempts_when_the_kv_pool_is_full():
    # 6 blocks of 4: two 10-token prompts plus one output token each hold every block.
    sched = make_scheduler(PriorityPolicy, num_blocks=6)
    sched.add_request(make_request("lo1", n_prompt=10, max_tokens=10, priority=1, arrival=0.0))
    sched.add_request(make_request("lo2", n_prompt=10, max_tokens=10, priority=2, arrival=1.0))
    step(sched)
    sched.add_request(make_request("hi", n_prompt=4, max_tokens=4, priority=0, arrival=2.0))
    out = step(sched)
    assert "lo2" in out.preempted_req_ids and "lo1" not in out.preempted_req_ids
    assert "hi" in out.num_scheduled_tokens
    admission_order(sched)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_equal_priority_never_preempts():
    sched = make_scheduler(PriorityPolicy, max_num_seqs=1)
    sched.add_request(make_request("first", max_tokens=10, priority=1, arrival=0.0))
    step(sched)
    sched.add_request(make_request("second", max_tokens=10, priority=1, arrival=1.0))
    outs = [step(sched) for _ in range(3)]
    assert not any(o.preempted_req_ids for o in outs)


def test_preempted_request_keeps_its_place_by_priority():
    sched = make_scheduler(PriorityPolicy, max_num_seqs=2)
    sched.add_request(make_request("p1", max_tokens=20, priority=1, arrival=0.0))
    sched.add_request(make_request("p2", max_tokens=20, priority=1, arrival=1.0))
    step(sched)
    sched.add_request(make_request("p1_late", max_tokens=20, priority=1, arrival=5.0))
    sched.add_request(make_request("p0", max_tokens=20, priority=0, arrival=6.0))
    out = step(sched)
    assert out.preempted_req_ids == {"p2"}
    # p2 waits ahead of the later p1_late: by (priority, arrival), not at the back.
    assert [r.request_id for r in sched.waiting] == ["p2", "p1_late"]


def test_fcfs_never_preempts_for_a_waiting_request():
    sched = make_scheduler(FCFSPolicy, max_num_seqs=1)
    sched.add_request(make_request("a", max_tokens=10, priority=9))
    step(sched)
    sched.add_request(make_request("b", max_tokens=10, priority=0))
    assert not step(sched).preempted_req_ids


# ---- SJF ------------------------------------------------------------------------------------


def test_sjf_admits_the_least_remaining_work_first():
    sched = make_scheduler(SJFPolicy, max_num_seqs=1)
    for req_id, n_prompt, max_tokens in [("long", 40, 40), ("short", 4, 2), ("mid", 10, 10), ("tiny", 2, 1)]:
        sched.add_request(make_request(req_id, n_prompt, max_tokens))
    assert admission_order(sched) == ["tiny", "short", "mid", "long"]


def test_sjf_uses_the_output_length_predictor():
    config = {"sjf": {"predictor": lambda request: 1 if request.request_id == "chatty" else 500}}
    sched = make_scheduler(SJFPolicy, max_num_seqs=1, plugin_config=config)
    sched.add_request(make_request("terse", 4, max_tokens=3))
    sched.add_request(make_request("chatty", 4, max_tokens=3))
    assert admission_order(sched) == ["chatty", "terse"]


def test_sjf_aging_bound_a_request_is_not_overtaken_after_w_over_a_seconds():
    # Work of "long": 100 prompt + 100 output = 200 tokens; a = 10 tokens/s -> 20 s.
    queue = SJFPolicy(EngineConfig(model="unused", plugin_config={"sjf": {"aging_tokens_per_s": 10}})).make_queue()
    long = make_request("long", 100, 100, arrival=0.0)
    queue.add(long)
    shorts = [make_request(f"s{t}", 1, 1, arrival=float(t)) for t in range(0, 40, 2)]
    for r in shorts:
        queue.add(r)
    order = [r.request_id for r in queue]
    overtook = order[: order.index("long")]
    assert overtook == [f"s{t}" for t in range(0, 20, 2)]  # only those arriving before t + W/a = 20 s


def test_sjf_aging_eventually_serves_a_long_request_under_a_stream_of_short_ones():
    sched = make_scheduler(SJFPolicy, max_num_seqs=1, plugin_config={"sjf": {"aging_tokens_per_s": 10}})
    sched.add_request(make_request("long", 20, 20, arrival=0.0))
    admitted_at = None
    for t in range(200):
        sched.add_request(make_request(f"s{t}", 1, 1, arrival=float(t)))
        if any(r.req_id == "long" for r in step(sched).scheduled_new_reqs):
            admitted_at = t
            break
    # W = 40 tokens, a = 10/s: shorts arriving after t = 4 s rank behind it.
    assert admitted_at is not None and admitted_at <= 6


@pytest.mark.parametrize("settings, problem", [
    ({"aging_tokens_per_s": 0}, "aging_tokens_per_s must be a number > 0"),
    ({"predictor": "no_such_module_xyz:f"}, "predictor 'no_such_module_xyz:f' cannot be loaded"),
    ({"agin": 1}, "unknown sjf settings ['agin']"),
])
def test_sjf_validate_reports_bad_settings(settings, problem):
    problems = SJFPolicy.validate(EngineConfig(model="unused", plugin_config={"sjf": settings}))
    assert len(problems) == 1 and problem in problems[0]


def test_engine_rejects_a_bad_policy_config_before_loading(llama_dir):
    with pytest.raises(ValueError, match="scheduling_policy='sjf'.*aging_tokens_per_s"):
        LLM(str(llama_dir), scheduling_policy="sjf", plugin_config={"sjf": {"aging_tokens_per_s": -1}})


# ---- through the engine ---------------------------------------------------------------------


def test_high_priority_request_submitted_into_a_full_engine_finishes_first_with_equal_outputs(llama_dir):
    prompts = [[10 + i] * (6 + 3 * i) for i in range(4)]
    high_prompt = [99] * 9
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    baseline = LLM(str(llama_dir), dtype="float32", block_size=8).generate(
        [{"prompt_token_ids": p} for p in prompts + [high_prompt]], params, use_tqdm=False
    )
    want = {str(i): o.outputs[0].token_ids for i, o in enumerate(baseline)}

    # 12 blocks x 8 = 96 slots: four requests growing to ~40 tokens fill the pool.
    llm = LLM(str(llama_dir), dtype="float32", block_size=8, num_kv_blocks=12, max_model_len=64,
              max_num_seqs=4, scheduling_policy="priority")
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params, priority=1)
    finished = []
    for _ in range(4):
        finished += [o.request_id for o in engine.step() if o.finished]
    assert engine.core.scheduler.num_running == 4 and not finished
    engine.add_request("4", {"prompt_token_ids": high_prompt}, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), priority=0)
    got = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished.append(o.request_id)
                got[o.request_id] = o.outputs[0].token_ids
    assert finished[0] == "4"
    assert engine.core.scheduler.num_preemptions > 0
    assert got["4"] == want["4"][:12]
    assert all(got[str(i)] == want[str(i)] for i in range(4))
    core = engine.core
    assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks
