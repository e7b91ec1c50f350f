"""The encoder cache manager and the scheduler's encoder budget, without a model.

The randomized test drives the real scheduler and KV cache manager with requests carrying
images (shared between requests, repeated inside one, of different sizes), random arrivals,
aborts, preemptions, chunking, encoder budgets and cache sizes, and a runner simulated as
the set of identifiers whose embeddings it holds. Every step, every image position a request
computes must find its image's embeddings there (encoded this step or kept from before), no
image is encoded while the runner still holds it, and once idle nothing is referenced and
every KV block is free.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagelm.config import EngineConfig
from pagelm.kv_cache import KVCacheManager, make_block_hasher
from pagelm.multimodal import MultiModalFeature
from pagelm.plugins.policies.fcfs import FCFSPolicy
from pagelm.request import Request, RequestStatus
from pagelm.sampling_params import SamplingParams
from pagelm.sched.encoder_cache import EncoderCacheManager
from pagelm.sched.scheduler import Scheduler
from pagelm.worker.output import ModelRunnerOutput

BS = 4


# ---- the manager alone ------------------------------------------------------------------------
def test_a_released_entry_stays_a_hit_until_its_room_is_needed():
    cache = EncoderCacheManager(cache_size=20)
    cache.allocate("a", "img1", 10)
    cache.release("a", "img1")
    assert cache.take_ref("b", "img1")  # freed lazily: still there
    cache.release("b", "img1")
    cache.allocate("c", "img2", 10)
    assert cache.take_evicted() == []  # room without evicting
    cache.allocate("c", "img3", 10)  # needs img1's room: the least recently released goes
    assert cache.take_evicted() == ["img1"]
    assert not cache.take_ref("d", "img1")
    assert (cache.stats.queries, cache.stats.hits) == (4, 1)


def test_a_referenced_entry_is_never_evicted_and_usage_counts_references():
    cache = EncoderCacheManager(cache_size=20)
    cache.allocate("a", "img1", 10)
    cache.allocate("b", "img2", 10)
    cache.release("b", "img2")
    assert cache.usage() == 0.5
    cache.allocate("c", "img3", 10)
    assert cache.take_evicted() == ["img2"]
    assert set(cache.sizes) == {"img1", "img3"}
    cache.free("a")
    cache.free("c")
    assert cache.usage() == 0.0 and cache.num_free_slots + cache.num_freeable == 20


# ---- the scheduler ----------------------------------------------------------------------------
class RandomVictimPolicy(FCFSPolicy):
    name = "random-victim"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.rng = random.Random(config.plugin_config.get("seed", 0))

    def select_victim(self, running):
        return self.rng.choice(running)

    def select_victim_for(self, request, running):
        return self.rng.choice(running) if running and self.rng.random() < 0.5 else None


IMAGE_SIZES = {"red": 6, "green": 3, "blue": 9}
IMAGE_TOKEN = 999


def make_request(req_id: str, pieces: list, max_tokens: int) -> Request:
    """``pieces``: token ids and image names, in prompt order."""
    ids, features = [], []
    for piece in pieces:
        if isinstance(piece, str):
            features.append(MultiModalFeature("image", piece, len(ids), IMAGE_SIZES[piece]))
            ids += [IMAGE_TOKEN] * IMAGE_SIZES[piece]
        else:
            ids.append(piece)
    return Request(req_id, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   block_hasher=make_block_hasher(BS), mm_features=features)


request_st = st.fixed_dictionaries({
    "pieces": st.lists(st.one_of(st.integers(1, 5), st.sampled_from(sorted(IMAGE_SIZES))), min_size=1, max_size=7),
    "max_tokens": st.integers(1, 4),
    "arrival": st.integers(0, 5),
    "abort_at": st.one_of(st.none(), st.integers(0, 10)),
})

case_st = st.fixed_dictionaries({
    "requests": st.lists(request_st, min_size=1, max_size=6),
    "num_blocks": st.integers(17, 40),
    "max_num_seqs": st.integers(1, 4),
    "max_num_batched_tokens": st.sampled_from([3, 8, 64]),
    "max_num_encoder_input_tokens": st.sampled_from([9, 12, 30]),
    "encoder_cache_size": st.sampled_from([9, 15, 40]),
    "prefix_caching": st.booleans(),
    "random_victims": st.booleans(),
    "seed": st.integers(0, 1000),
})


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=case_st)
def test_every_image_position_finds_its_embeddings(case):
    config = EngineConfig(
        model="unused", block_size=BS, max_num_seqs=case["max_num_seqs"],
        max_num_batched_tokens=case["max_num_batched_tokens"],
        max_num_encoder_input_tokens=case["max_num_encoder_input_tokens"],
        encoder_cache_size=case["encoder_cache_size"], enable_prefix_caching=case["prefix_caching"],
        plugin_config={"seed": case["seed"]},
    )
    policy = RandomVictimPolicy(config) if case["random_victims"] else FCFSPolicy(config)
    cache = EncoderCacheManager(config.encoder_cache_embeddings)
    kv = KVCacheManager(case["num_blocks"], BS, config.enable_prefix_caching)
    sched = Scheduler(config, kv, policy, max_model_len=BS * 17, encoder_cache=cache)
    pending = sorted(enumerate(case["requests"]), key=lambda item: item[1]["arrival"])
    features: dict[str, list[MultiModalFeature]] = {}
    aborts: dict[str, int] = {}
    held: set[str] = set()  # identifiers whose embeddings the simulated runner holds
    step = 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0][1]["arrival"] <= step:
            i, r = pending.pop(0)
            req = make_request(str(i), r["pieces"], r["max_tokens"])
            features[req.request_id] = req.mm_features
            sched.add_request(req)
            if r["abort_at"] is not None:
                aborts[req.request_id] = step + r["abort_at"]
        sched.finish_requests([r for r, when in aborts.items() if when <= step], RequestStatus.FINISHED_ABORTED)
        out = sched.schedule()
        held -= set(out.free_encoder_identifiers)
        for req_id, indices in out.scheduled_encoder_inputs.items():
            for index in indices:
                identifier = features[req_id][index].identifier
                assert identifier not in held, f"step {step}: {identifier} encoded again while held"
                held.add(identifier)
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        starts |= {r.req_id: r.num_computed_tokens for r in out.scheduled_cached_reqs}
        for req_id, n in out.num_scheduled_tokens.items():
            for f in features[req_id]:
                if f.overlaps(starts[req_id], starts[req_id] + n):
                    assert f.identifier in held, f"step {step}: request {req_id} computes {f.identifier} unencoded"
        assert sum(f.length for r, ix in out.scheduled_encoder_inputs.items() for f in
                   (features[r][i] for i in ix)) <= config.encoder_budget
        req_ids = list(out.num_scheduled_tokens)
        sched.update_from_output(out, ModelRunnerOutput(req_ids, [[7] for _ in req_ids]))
        step += 1
        assert step < 2000, f"no progress: {case}"
    assert not cache.refs and not cache.req_refs
    assert cache.num_free_slots + cache.num_freeable == cache.cache_size
    assert kv.num_free_blocks == kv.num_blocks

