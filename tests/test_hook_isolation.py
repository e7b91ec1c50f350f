"""A plugin's exception in a lifecycle hook is caught, logged with the plugin's name and
counted; the engine and every other plugin carry on."""

import logging

import pytest
from pagelm import LLM, SamplingParams, hookimpl
from pagelm.engine.core_loop import SchedulerStats
from pagelm.config import EngineConfig
from pagelm.plugins.metrics.prometheus import PrometheusStatLogger
from pagelm.plugin_manager import get_plugin_manager

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


class Raises:
    @hookimpl
    def pagelm_engine_started(self, engine):
        raise RuntimeError("started: boom")

    @hookimpl
    def pagelm_request_finished(self, request, reason):
        raise RuntimeError("finished: boom")


class Records:
    def __init__(self):
        self.finished = []

    @hookimpl
    def pagelm_request_finished(self, request, reason):
        self.finished.append((request.request_id, reason))


@pytest.fixture
def plugins():
    records = Records()
    pm = get_plugin_manager()
    pm.register(Raises(), name="test-raises")
    pm.register(records, name="test-records")
    yield records
    pm.unregister("test-raises")
    pm.unregister("test-records")


def test_a_raising_lifecycle_hook_fails_nobody(llama_dir, plugins, caplog):
    pm = get_plugin_manager()
    before = pm.num_hook_errors
    with caplog.at_level(logging.ERROR, logger="pagelm"):
        llm = LLM(str(llama_dir), dtype="float32", device="cpu")  # engine_started raises
        outs = llm.generate([{"prompt_token_ids": [5 + i, 6, 7]} for i in range(3)], PARAMS, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3, 3]
    assert sorted(plugins.finished) == [("0", "length"), ("1", "length"), ("2", "length")]
    assert pm.num_hook_errors - before == 4  # engine_started once, request_finished three times
    assert "pagelm plugin 'test-raises' raised in pagelm_request_finished" in caplog.text
    stats = SchedulerStats.of(llm.engine.core)
    assert stats.num_plugin_errors == pm.num_hook_errors


def test_plugin_errors_reach_the_metrics():
    metrics = PrometheusStatLogger(EngineConfig(model="m"), "m", 512, SchedulerStats())
    metrics.record(SchedulerStats(num_plugin_errors=2))
    metrics.record(SchedulerStats(num_plugin_errors=5))
    assert metrics.registry.get_sample_value("pagelm:plugin_errors_total", {"model_name": "m", "engine": "0"}) == 5
