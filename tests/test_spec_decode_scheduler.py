"""The scheduler's side of speculative decoding, driven without a model: drafts ride after the
known tokens inside the token budget, rejected ones roll progress back, prefix-cache hashes
cover accepted tokens only, and a stop inside an accepted run ends the request there."""

from pagelm.config import EngineConfig
from pagelm.kv_cache import KVCacheManager, make_block_hasher
from pagelm.plugins.policies.fcfs import FCFSPolicy
from pagelm.request import Request, RequestStatus
from pagelm.sampling_params import SamplingParams
from pagelm.sched.scheduler import Scheduler
from pagelm.worker.output import ModelRunnerOutput

BS = 4
EOS = 2


def make_scheduler(num_blocks=64, lookahead=0, max_model_len=1024, **kw):
    config = EngineConfig(model="unused", block_size=BS, **kw)
    kv = KVCacheManager(num_blocks, BS, config.enable_prefix_caching)
    return Scheduler(config, kv, FCFSPolicy(config), max_model_len=max_model_len, num_lookahead_tokens=lookahead)


def make_request(req_id="r", prompt=(10, 11, 12, 13, 14, 15), **params):
    params = {"max_tokens": 32, **params}
    return Request(req_id, list(prompt), SamplingParams(**params), eos_token_ids=frozenset([EOS]),
                   block_hasher=make_block_hasher(BS))


def step(sched, sampled, drafts=None):
    """One step: every scheduled request samples ``sampled[req_id]`` (a list of tokens) and
    proposes ``drafts[req_id]``."""
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    runner = ModelRunnerOutput(ids, [list(sampled.get(i, [7])) for i in ids])
    if drafts is not None:
        runner.draft_token_ids = [list(drafts.get(i, [])) for i in ids]
    core_outs, _ = sched.update_from_output(out, runner)
    return out, {o.request_id: o for o in core_outs}


def prefilled(sched, req, first=20, drafts=(30, 31, 32)):
    """Admit ``req`` and run its prefill: it samples ``first`` and is proposed ``drafts``."""
    sched.add_request(req)
    step(sched, {req.request_id: [first]}, {req.request_id: list(drafts)})
    assert req.spec_token_ids == list(drafts)


def test_drafts_follow_the_known_tokens_and_count_in_the_budget():
    sched = make_scheduler()
    req = make_request()
    prefilled(sched, req)
    out = sched.schedule()
    # The last sampled token (20) plus three drafts, from position 6 on.
    assert out.num_scheduled_tokens == {"r": 4}
    assert out.scheduled_spec_decode_tokens == {"r": [30, 31, 32]}
    assert out.scheduled_cached_reqs[0].num_computed_tokens == 6


def test_a_short_budget_trims_drafts_first():
    sched = make_scheduler(max_num_batched_tokens=10)
    a, b = make_request("a"), make_request("b", prompt=range(40, 46))
    prefilled(sched, a)
    sched.add_request(b)  # its 6-token prefill is scheduled after a's 4 tokens
    step(sched, {"a": [30, 31, 32, 33], "b": [50]}, {"a": [60, 61, 62], "b": [70, 71, 72]})
    out = sched.schedule()  # a: 1 + 3, b: 1 + 3 -> 8 <= 10, all fit
    assert out.scheduled_spec_decode_tokens == {"a": [60, 61, 62], "b": [70, 71, 72]}
    sched.update_from_output(out, ModelRunnerOutput(["a", "b"], [[60, 1], [70, 1]]))
    sched.config.max_num_batched_tokens = 6
    a.spec_token_ids, b.spec_token_ids = [80, 81, 82], [90, 91, 92]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4, "b": 2}
    assert out.scheduled_spec_decode_tokens == {"a": [80, 81, 82], "b": [90]}


def test_rejected_drafts_roll_back_progress():
    sched = make_scheduler()
    req = make_request()
    prefilled(sched, req)
    # Draft 30 accepted, 31 rejected: the target's own token there is 40.
    _, outs = step(sched, {"r": [30, 40]}, {"r": [41, 42, 43]})
    assert req.output_token_ids == [20, 30, 40]
    assert req.num_computed_tokens == req.num_tokens - 1 == 8
    assert (outs["r"].num_draft_tokens, outs["r"].num_accepted_tokens) == (3, 1)
    stats = sched.spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0]
    # The next step starts at the first position whose KV is stale.
    out = sched.schedule()
    assert out.scheduled_cached_reqs[0].num_computed_tokens == 8


def test_lookahead_slots_are_reserved_for_a_draft_model():
    sched = make_scheduler(lookahead=3)
    req = make_request(prompt=range(10, 17))  # 7 tokens
    sched.add_request(req)
    step(sched, {"r": [20]}, {"r": [30, 31, 32]})
    # The prefill's 7 tokens + 3 lookahead slots: 10 slots -> 3 blocks.
    assert len(sched.kv.get_block_ids("r")) == 3
    step(sched, {"r": [30, 31, 32, 33]}, {"r": [34, 35, 36]})
    # Positions up to 10 (7 + 1 + 3 drafts) computed, 3 more reserved: 14 slots -> 4 blocks.
    assert len(sched.kv.get_block_ids("r")) == 4


def test_prefix_cache_hashes_cover_accepted_tokens_only():
    sched = make_scheduler(enable_prefix_caching=True)
    req = make_request(prompt=range(10, 16))  # 6 tokens: block 0 full, block 1 half
    prefilled(sched, req, first=20, drafts=(30, 31, 32))
    # Positions 6..9 hold 20, 30, 31, 32; all drafts rejected: only 20 and the new 40 are real.
    step(sched, {"r": [40]}, {"r": []})
    assert req.all_token_ids == [10, 11, 12, 13, 14, 15, 20, 40]
    hasher = make_block_hasher(BS)
    fresh = Request("check", req.all_token_ids, SamplingParams(), block_hasher=hasher)
    assert req.block_hashes == fresh.block_hashes  # two full blocks, of real tokens
    assert sched.kv.num_cached_blocks["r"] == 1  # block 1's KV at position 7 is a draft's: not cached yet
    step(sched, {"r": [41]}, {"r": []})
    assert sched.kv.num_cached_blocks["r"] == 2


def test_eos_inside_an_accepted_run_ends_the_request_there():
    sched = make_scheduler()
    req = make_request()
    prefilled(sched, req, drafts=(30, EOS, 32))
    _, outs = step(sched, {"r": [30, EOS, 32, 33]})
    assert req.output_token_ids == [20, 30, EOS]
    assert outs["r"].new_token_ids == [30, EOS] and outs["r"].finish_reason == "stop"
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_stop_token_and_max_tokens_inside_an_accepted_run():
    sched = make_scheduler()
    stop = make_request("stop", stop_token_ids=[31])
    capped = make_request("capped", prompt=range(40, 46), max_tokens=3)
    sched.add_request(stop)
    sched.add_request(capped)
    step(sched, {"stop": [20], "capped": [20]}, {"stop": [30, 31, 32], "capped": [50, 51, 52]})
    # max_tokens=3 with one output already: at most one draft, so the step ends at 3 tokens.
    assert capped.spec_token_ids == [50]
    _, outs = step(sched, {"stop": [30, 31, 32, 33], "capped": [50, 51]})
    assert stop.output_token_ids == [20, 30, 31] and outs["stop"].stop_reason == 31
    assert capped.output_token_ids == [20, 50, 51] and outs["capped"].finish_reason == "length"


def test_drafts_are_capped_at_max_model_len():
    sched = make_scheduler(max_model_len=10)
    req = make_request(prompt=range(10, 17), max_tokens=None)  # 7 tokens, room for 3 outputs
    sched.add_request(req)
    step(sched, {"r": [20]}, {"r": [30, 31, 32]})
    assert req.spec_token_ids == [30]  # 8 tokens: one draft + the target's token reach 10
    step(sched, {"r": [30, 33]})
    assert req.num_tokens == 10 and req.status == RequestStatus.FINISHED_LENGTH


def test_preemption_drops_drafts():
    sched = make_scheduler(num_blocks=4)
    a, b = make_request("a", prompt=range(10, 17)), make_request("b", prompt=range(40, 47))
    sched.add_request(a)
    sched.add_request(b)
    step(sched, {"a": [20], "b": [20]}, {"a": [30, 31, 32], "b": [30, 31, 32]})
    # a's 1 + 3 tokens need a third block: the newest request gives way.
    out, _ = step(sched, {"a": [30, 31, 32, 33]})
    assert out.preempted_req_ids == {"b"}
    assert b.spec_token_ids == [] and b.status == RequestStatus.PREEMPTED
