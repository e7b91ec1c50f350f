"""Plugins chosen by name reach the engine, and lifecycle hooks fire once, not per token."""

import pytest

from pagelm import LLM, SamplingParams, hookimpl
from pagelm.plugin_manager import get_plugin_manager
from pagelm.sched.policy import SchedulingPolicy


class LIFOPolicy(SchedulingPolicy):
    """Admits the newest waiting request first."""

    name = "lifo_test"

    def rank(self, request):
        return -request.arrival_time


class Recorder:
    def __init__(self):
        self.events = []

    @hookimpl
    def pagelm_register_scheduling_policies(self, registry):
        registry.add(LIFOPolicy.name, LIFOPolicy)

    @hookimpl
    def pagelm_configure(self, config):
        self.events.append(("configure", config.scheduling_policy))

    @hookimpl
    def pagelm_engine_started(self, engine):
        self.events.append(("started", engine.num_kv_blocks))

    @hookimpl
    def pagelm_request_finished(self, request, reason):
        self.events.append(("finished", request.request_id, reason))

    @hookimpl
    def pagelm_engine_shutdown(self, engine):
        self.events.append(("shutdown",))


@pytest.fixture
def recorder():
    rec = Recorder()
    get_plugin_manager().register(rec, name="test-recorder")
    yield rec
    get_plugin_manager().unregister("test-recorder")


def test_policy_registered_in_process_is_selected_by_name(llama_dir, recorder):
    llm = LLM(str(llama_dir), dtype="float32", max_num_seqs=1, scheduling_policy="lifo_test")
    outs = llm.generate([{"prompt_token_ids": [5 + i] * 4} for i in range(3)], SamplingParams(max_tokens=2), use_tqdm=False)
    first_token_times = [o.metrics.first_token_time for o in outs]
    # One at a time, newest first: the last prompt is served first.
    assert first_token_times[2] < first_token_times[1] < first_token_times[0]


def test_lifecycle_hooks_fire_once_per_engine_and_request(llama_dir, recorder):
    llm = LLM(str(llama_dir), dtype="float32")
    llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    llm.engine.shutdown()
    kinds = [e[0] for e in recorder.events]
    assert kinds == ["configure", "started", "finished", "finished", "shutdown"]
    assert {e[2] for e in recorder.events if e[0] == "finished"} == {"length"}
    assert recorder.events[1][1] == llm.engine.core.num_kv_blocks


def test_auto_picks_a_third_party_backend_by_its_declared_priority(llama_dir):
    from pagelm.backends.torch import TorchAttentionBackend

    class Preferred(TorchAttentionBackend):
        name = "preferred_on_cpu"
        auto_priority = {"cpu": 500}

    class Undeclared(TorchAttentionBackend):
        name = "undeclared"  # no auto_priority: auto never picks it

    class Plugin:
        @hookimpl
        def pagelm_register_attention_backends(self, registry):
            registry.add(Preferred.name, Preferred)
            registry.add(Undeclared.name, Undeclared)

    get_plugin_manager().register(Plugin(), name="test-auto-backends")
    try:
        llm = LLM(str(llama_dir), dtype="float32", device="cpu")
        assert llm.engine.core.runner.backend is Preferred
        Preferred.auto_priority = {}
        llm = LLM(str(llama_dir), dtype="float32", device="cpu")
        assert llm.engine.core.runner.backend.name == "torch"
    finally:
        get_plugin_manager().unregister("test-auto-backends")
