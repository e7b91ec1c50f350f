"""Data parallelism: N engine replicas behind one API, a router plugin picking each request's
replica. The oracle is the one-replica run (greedy token ids identical); aborts and step
faults reach only the replica that holds the request; the prefix-affinity router's prefix-
cache hit rate beats round-robin and least-loaded on a shared-prefix workload."""

from __future__ import annotations

import asyncio
import random

import pytest

from pagelm import LLM, SamplingParams, hookimpl
from pagelm.engine.async_llm import AsyncLLM
from pagelm.engine.core_output import EngineStepError
from pagelm.plugin_manager import get_plugin_manager
from pagelm.plugins.routers.router import Router

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _prompts(n: int, length: int = 5) -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(length)]} for i in range(n)]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_dp2_greedy_equals_one_replica_and_uses_both(llama_dir):
    prompts = _prompts(6)
    with LLM(str(llama_dir), dtype="float32") as llm:
        plain = _ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    with LLM(str(llama_dir), dtype="float32", data_parallel_size=2) as llm:
        got = _ids(llm.generate(prompts, GREEDY, use_tqdm=False))
        replicas = llm.engine.core.replicas
        # least_loaded alternates over idle replicas: 3 requests each.
        assert [r.kv_cache_manager.prefix_cache_stats.queries for r in replicas] == [15, 15]
        assert all(r.kv_cache_manager.num_free_blocks == r.num_kv_blocks for r in replicas)
    assert got == plain


def test_an_abort_reaches_only_the_replica_holding_the_request(llama_dir):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    with LLM(str(llama_dir), dtype="float32", data_parallel_size=2, data_parallel_router="round_robin") as llm:
        engine = llm.engine
        for i, p in enumerate(_prompts(4)):
            engine.add_request(f"r{i}", p, params)
        engine.step()
        r0, r1 = engine.core.replicas
        assert sorted(r0.scheduler.requests) == ["r0", "r2"] and sorted(r1.scheduler.requests) == ["r1", "r3"]
        engine.abort_request(["r1"])
        assert sorted(r1.scheduler.requests) == ["r3"] and sorted(r0.scheduler.requests) == ["r0", "r2"]
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert sorted(finished) == ["r0", "r2", "r3"]
        assert all(len(o.outputs[0].token_ids) == 30 for o in finished.values())
        assert engine.core.owner == {} and [x.num_unfinished for x in engine.core.loads()] == [0, 0]
        assert all(r.kv_cache_manager.num_free_blocks == r.num_kv_blocks for r in (r0, r1))


def test_a_failing_step_fails_only_its_replicas_requests(llama_dir):
    """AsyncLLM with each replica's core loop in a thread: replica 1's step raises once."""
    engine = AsyncLLM.from_model(
        str(llama_dir), engine_process=False, dtype="float32", data_parallel_size=2,
        data_parallel_router="round_robin",
    )
    core1 = engine.core.replicas[1].core
    launch = core1.runner.launch
    calls = []

    def failing_launch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected device fault")
        return launch(*args, **kwargs)

    core1.runner.launch = failing_launch

    async def run(prompt, request_id):
        ids = []
        async for out in engine.generate(prompt, GREEDY, request_id):
            ids += out.outputs[0].token_ids
        return ids

    async def main():
        return await asyncio.gather(*(run(p, f"r{i}") for i, p in enumerate(_prompts(4))), return_exceptions=True)

    loop = asyncio.new_event_loop()
    try:
        results = loop.run_until_complete(main())
    finally:
        engine.shutdown()
        loop.close()
    # round_robin: r0, r2 on replica 0 (served); r1, r3 on replica 1 (failed by its step).
    assert [len(results[0]), len(results[2])] == [10, 10]
    assert all(isinstance(results[i], EngineStepError) and "injected device fault" in str(results[i]) for i in (1, 3))


def test_async_dp2_in_processes_equals_one_replica(llama_dir):
    async def run(engine, prompts):
        async def one(p, rid):
            ids = []
            async for out in engine.generate(p, GREEDY, rid):
                ids += out.outputs[0].token_ids
            return ids

        return await asyncio.gather(*(one(p, f"r{i}") for i, p in enumerate(prompts)))

    prompts = _prompts(4)
    loop = asyncio.new_event_loop()
    engine = AsyncLLM.from_model(str(llama_dir), dtype="float32", data_parallel_size=2)
    try:
        got = loop.run_until_complete(run(engine, prompts))
        assert engine.core.num_kv_blocks == sum(r.num_kv_blocks for r in engine.core.replicas)
    finally:
        engine.shutdown()
        loop.close()
    with LLM(str(llama_dir), dtype="float32") as llm:
        assert list(got) == _ids(llm.generate(prompts, GREEDY, use_tqdm=False))


def shared_prefix_hit_rate(model_dir, router: str, num_replicas: int = 2, num_prefixes: int = 8, waves: int = 4,
                           seed: int = 0) -> float:
    """Prefix-cache hit rate (cached prompt tokens / prompt tokens looked up, all replicas)
    for waves of requests that each send one request per shared prefix (2 blocks of 16
    tokens) plus a unique 8-token suffix, in a shuffled order."""
    rng = random.Random(seed)
    prefixes = [[3 + (p * 37 + j) % 500 for j in range(32)] for p in range(num_prefixes)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with LLM(str(model_dir), dtype="float32", data_parallel_size=num_replicas, data_parallel_router=router,
             block_size=16) as llm:
        for wave in range(waves):
            order = list(range(num_prefixes))
            rng.shuffle(order)
            prompts = [{"prompt_token_ids": prefixes[p] + [400 + wave, 401 + p] * 4} for p in order]
            llm.generate(prompts, params, use_tqdm=False)
        stats = [r.kv_cache_manager.prefix_cache_stats for r in llm.engine.core.replicas]
    return sum(s.hits for s in stats) / sum(s.queries for s in stats)


def test_prefix_affinity_routing_raises_the_prefix_cache_hit_rate(llama_dir):
    rates = {router: shared_prefix_hit_rate(llama_dir, router) for router in ("round_robin", "least_loaded", "prefix_affinity")}
    print(f"shared-prefix hit rate, 2 replicas: {rates}")
    # Affinity computes each prefix once (8 misses of 32 tokens in 32 requests of 40 tokens);
    # the balancers compute most prefixes on both replicas.
    assert rates["prefix_affinity"] == pytest.approx(24 * 32 / (32 * 40))
    assert rates["prefix_affinity"] >= rates["round_robin"] + 0.1
    assert rates["prefix_affinity"] >= rates["least_loaded"] + 0.1


class _BadRouter(Router):
    name = "bad"

    def route(self, request, loads):
        return len(loads)


class _BadRouterPlugin:
    PAGELM_PLUGIN_API = "2.8"

    @hookimpl
    def pagelm_register_routers(self, registry):
        registry.add("bad", _BadRouter)


def test_a_router_choosing_no_replica_is_a_clear_error(llama_dir):
    plugins = get_plugin_manager()
    plugins.register(_BadRouterPlugin(), name="bad-router")
    try:
        with LLM(str(llama_dir), dtype="float32", data_parallel_size=2, data_parallel_router="bad") as llm:
            with pytest.raises(ValueError, match=r"router 'bad' chose replica 2 .* must be an int in \[0, 2\)"):
                llm.generate(_prompts(1), GREEDY, use_tqdm=False)
    finally:
        plugins.unregister("bad-router")


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"data_parallel_size": 0}, "data_parallel_size must be >= 1"),
        ({"data_parallel_size": 2, "data_parallel_router": "nope"}, "unknown router 'nope'.*least_loaded"),
        ({"data_parallel_size": 2, "tensor_parallel_size": 2}, "replicas in one process cannot each have"),
        ({"data_parallel_size": 2, "data_parallel_router": "prefix_affinity",
          "plugin_config": {"prefix_affinity_max_imbalance": -1}},
         r"plugin_config\['prefix_affinity_max_imbalance'\] must be an int >= 0"),
    ],
)
def test_bad_data_parallel_config_is_a_clear_error(llama_dir, kw, match):
    with pytest.raises(Exception, match=match):
        LLM(str(llama_dir), dtype="float32", **kw)


class _LastReplicaRouter(Router):
    """A third-party router: every request to the last replica; remembers who left."""

    name = "last_replica"
    finished: list[tuple[str, int]] = []

    def route(self, request, loads):
        return len(loads) - 1

    def request_finished(self, request_id, replica):
        self.finished.append((request_id, replica))


class _LastReplicaPlugin:
    PAGELM_PLUGIN_API = "2.8"

    @hookimpl
    def pagelm_register_routers(self, registry):
        registry.add("last_replica", _LastReplicaRouter)


def test_hook_pagelm_register_routers(llama_dir):
    plugins = get_plugin_manager()
    plugins.register(_LastReplicaPlugin(), name="last-replica-router")
    try:
        with LLM(str(llama_dir), dtype="float32", data_parallel_size=2, data_parallel_router="last_replica") as llm:
            llm.generate(_prompts(3), GREEDY, use_tqdm=False)
            queries = [r.kv_cache_manager.prefix_cache_stats.queries for r in llm.engine.core.replicas]
            assert queries[0] == 0 and queries[1] > 0
            assert sorted(llm.engine.core.router.finished) == [("0", 1), ("1", 1), ("2", 1)]
    finally:
        plugins.unregister("last-replica-router")


def test_replica_stats_sum_field_by_field():
    # The KV tier's stats are nested; summing them whole raised in the async pump, which
    # then left every request waiting.
    from pagelm.engine.core_loop import SchedulerStats
    from pagelm.plugins.data_parallel.replicas import sum_stats
    from pagelm.kv_offload import KVOffloadStats

    a = SchedulerStats(num_running=2, kv_offload=KVOffloadStats(num_blocks=8, block_bytes=4096, hit_blocks=3),
                       encoder_cache_usage=0.5, spec_num_accepted_tokens_per_pos=[1, 2])
    b = SchedulerStats(num_running=1, kv_offload=KVOffloadStats(num_blocks=8, block_bytes=4096, hit_blocks=1),
                       encoder_cache_usage=0.25, spec_num_accepted_tokens_per_pos=[3])
    total = sum_stats([a, b])
    assert total.num_running == 3 and total.spec_num_accepted_tokens_per_pos == [4, 2]
    assert (total.kv_offload.num_blocks, total.kv_offload.block_bytes, total.kv_offload.hit_blocks) == (16, 4096, 4)
    assert total.encoder_cache_usage == 0.375


def test_hook_pagelm_register_data_parallel(llama_dir, monkeypatch):
    # The built-in left out and a replacement registered: the engine makes the replacement.
    import pagelm.plugin_manager as plugin_manager
    from pagelm.plugins.data_parallel.replicas import DataParallelCore

    class CountingReplicas(DataParallelCore):
        made = 0

        def __init__(self, config, eos_token_ids, core_factory):
            CountingReplicas.made += 1
            super().__init__(config, eos_token_ids, core_factory)

    class Plugin:
        PAGELM_PLUGIN_API = "2.10"

        @hookimpl
        def pagelm_register_data_parallel(self, registry):
            registry.add("counting", CountingReplicas)

    monkeypatch.setenv("PAGELM_DISABLE_PLUGINS", "data_parallel")
    monkeypatch.setattr(plugin_manager, "_manager", plugin_manager.PluginManager())
    with pytest.raises(ValueError, match=r"needs exactly one data-parallel plugin; registered: \(none"):
        LLM(str(llama_dir), dtype="float32", data_parallel_size=2)
    plugin_manager.get_plugin_manager().register(Plugin(), name="counting-replicas")
    with LLM(str(llama_dir), dtype="float32", data_parallel_size=2) as llm:
        outs = llm.generate(_prompts(2), GREEDY, use_tqdm=False)
        assert type(llm.engine.core) is CountingReplicas and CountingReplicas.made == 1
    assert [len(o.outputs[0].token_ids) for o in outs] == [10, 10]


def test_a_replica_that_fails_to_start_raises_its_own_error_and_frees_the_others(llama_dir):
    # The second replica's start fails (on a GPU: its device's memory, say): the caller sees
    # that error, not one from the cleanup, and the first replica is shut down.
    from pagelm.config import EngineConfig
    from pagelm.engine.engine_core import EngineCore
    from pagelm.plugins.data_parallel.replicas import DataParallelCore

    shut_down = []

    class Replica(EngineCore):
        def shutdown(self):
            shut_down.append(self)
            super().shutdown()

    def factory(config, eos_token_ids):
        if shut_down or getattr(factory, "made", 0):
            raise RuntimeError("replica 1 could not start")
        factory.made = 1
        return Replica(config, eos_token_ids)

    config = EngineConfig(model=str(llama_dir), dtype="float32", data_parallel_size=2)
    with pytest.raises(RuntimeError, match="replica 1 could not start"):
        DataParallelCore(config, frozenset(), factory)
    assert len(shut_down) == 1
