"""Scheduler mechanism with the FCFS policy, driven without a model: each step's
ModelRunnerOutput is built by hand (token 7 for every request that reached its end)."""

from pagelm.config import EngineConfig, default_max_num_batched_tokens
from pagelm.kv_cache import KVCacheManager, make_block_hasher
from pagelm.plugins.policies.fcfs import FCFSPolicy
from pagelm.request import Request, RequestStatus
from pagelm.sampling_params import SamplingParams
from pagelm.sched.scheduler import Scheduler
from pagelm.worker.output import ModelRunnerOutput

BS = 4


def make_scheduler(num_blocks=64, **kw):
    config = EngineConfig(model="unused", block_size=BS, **kw)
    kv = KVCacheManager(num_blocks, BS, config.enable_prefix_caching)
    return Scheduler(config, kv, FCFSPolicy(config), max_model_len=1024)


def make_request(req_id, n_prompt, max_tokens=4, base=0):
    return Request(
        req_id,
        list(range(base, base + n_prompt)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        block_hasher=make_block_hasher(BS),
    )


def step(sched):
    out = sched.schedule()
    req_ids = list(out.num_scheduled_tokens)
    sched.update_from_output(out, ModelRunnerOutput(req_ids, [[7] for _ in req_ids]))
    return out


def run_to_end(sched, max_steps=500):
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        outs.append(step(sched))
    raise AssertionError("requests did not finish")


def test_budget_is_respected_every_step():
    sched = make_scheduler(max_num_batched_tokens=10)
    for i in range(5):
        sched.add_request(make_request(str(i), 13, base=100 * i))
    for out in run_to_end(sched):
        assert out.total_num_scheduled_tokens <= 10
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add_request(make_request(str(i), 3, base=100 * i))
    out = step(sched)
    assert set(out.num_scheduled_tokens) == {"0", "1"}
    assert sched.num_running == 2 and sched.num_waiting == 2


def test_fcfs_admits_in_arrival_order():
    sched = make_scheduler(max_num_batched_tokens=8)
    for i in range(3):
        sched.add_request(make_request(str(i), 8, base=100 * i))
    first_scheduled = []
    for out in run_to_end(sched):
        for r in out.scheduled_new_reqs:
            first_scheduled.append(r.req_id)
    assert first_scheduled == ["0", "1", "2"]


def test_decodes_are_never_starved_by_a_long_prefill():
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("d0", 3, max_tokens=20))
    sched.add_request(make_request("d1", 3, max_tokens=20, base=50))
    step(sched)  # both prefilled, now decoding
    sched.add_request(make_request("long", 200, max_tokens=2, base=500))
    for _ in range(10):
        out = step(sched)
        assert out.num_scheduled_tokens["d0"] == 1
        assert out.num_scheduled_tokens["d1"] == 1
        assert out.num_scheduled_tokens.get("long", 0) <= 14


def test_long_prompt_is_chunked_by_the_threshold():
    sched = make_scheduler(long_prefill_token_threshold=5)
    sched.add_request(make_request("a", 12))
    chunks = [step(sched).num_scheduled_tokens["a"] for _ in range(3)]
    assert chunks == [5, 5, 2]
    req = sched.requests["a"]
    assert req.num_output_tokens == 1  # only the last chunk samples a token


def test_max_num_partial_prefills_limits_concurrent_chunked_prompts():
    sched = make_scheduler(max_num_batched_tokens=100, long_prefill_token_threshold=8, max_num_partial_prefills=1)
    sched.add_request(make_request("a", 30))
    sched.add_request(make_request("b", 30, base=100))
    out = step(sched)
    assert out.num_scheduled_tokens == {"a": 8}


def test_full_pool_preempts_newest_and_everyone_finishes():
    # 6 blocks of 4 = 24 slots; two requests of 8 prompt + 12 output tokens need 10 blocks.
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    sched.add_request(make_request("a", 8, max_tokens=12))
    sched.add_request(make_request("b", 8, max_tokens=12, base=100))
    outs = run_to_end(sched)
    preempted = set().union(*(o.preempted_req_ids for o in outs))
    assert preempted == {"b"}
    assert sched.num_preemptions >= 1
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_preempted_request_resumes_with_all_its_tokens():
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    a = make_request("a", 8, max_tokens=12)
    b = make_request("b", 8, max_tokens=12, base=100)
    sched.add_request(a)
    sched.add_request(b)
    resumed = None
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out = step(sched)
        for new in out.scheduled_new_reqs:
            if new.req_id == "b" and new.output_token_ids:
                resumed = new
    assert resumed is not None
    assert resumed.prompt_token_ids == list(range(100, 108))
    assert resumed.output_token_ids and set(resumed.output_token_ids) == {7}
    assert b.num_output_tokens == 12 and b.status == RequestStatus.FINISHED_LENGTH


def test_abort_frees_blocks_and_tells_the_runner():
    sched = make_scheduler()
    sched.add_request(make_request("a", 10, max_tokens=50))
    step(sched)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    out = sched.schedule()
    assert out.finished_req_ids == {"a"}


def test_eos_and_stop_token_ids_end_requests():
    sched = make_scheduler()
    eos_req = Request("e", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_ids=frozenset({7}))
    stop_req = Request("s", [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[7]))
    sched.add_request(eos_req)
    sched.add_request(stop_req)
    step(sched)
    assert eos_req.status == RequestStatus.FINISHED_STOPPED and eos_req.stop_reason is None
    assert stop_req.status == RequestStatus.FINISHED_STOPPED and stop_req.stop_reason == 7


def test_min_tokens_delays_eos():
    sched = make_scheduler()
    req = Request("e", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=3), eos_token_ids=frozenset({7}))
    sched.add_request(req)
    run_to_end(sched)
    assert req.num_output_tokens == 3


def test_prefix_hits_skip_computed_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("a", 9))
    run_to_end(sched)
    sched.add_request(make_request("b", 9))
    out = step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert out.num_scheduled_tokens["b"] == 1


def test_step_budget_defaults_by_device_when_not_given():
    # Unset: the device's default (smaller on CPU, where a smaller step is faster per token).
    assert default_max_num_batched_tokens("cpu") == 2048
    assert default_max_num_batched_tokens("cuda") == 8192
    assert EngineConfig(model="unused", device="cpu").max_num_batched_tokens == 2048
    # device="cuda" is resolved lazily (resolved_device checks CUDA), so it needs no GPU here.
    assert EngineConfig(model="unused", device="cuda:1").max_num_batched_tokens == 8192
    # Given: kept, on either device.
    assert EngineConfig(model="unused", device="cpu", max_num_batched_tokens=8192).max_num_batched_tokens == 8192
    assert EngineConfig(model="unused", device="cuda", max_num_batched_tokens=512).max_num_batched_tokens == 512


def test_cpu_default_budget_splits_a_longer_prompt():
    config = EngineConfig(model="unused", block_size=BS, device="cpu")
    sched = Scheduler(config, KVCacheManager(1024, BS, True), FCFSPolicy(config), max_model_len=4096)
    sched.add_request(make_request("long", 3000, max_tokens=1))
    first, second = step(sched), step(sched)
    assert first.num_scheduled_tokens == {"long": 2048}
    assert second.num_scheduled_tokens == {"long": 952}
