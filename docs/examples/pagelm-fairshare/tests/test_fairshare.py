"""The fair-share policy passes pagelm's conformance kit and interleaves tenants."""

from pagelm.config import EngineConfig
from pagelm.request import Request
from pagelm.sampling_params import SamplingParams
from pagelm.models.testing import build_tiny_model
from pagelm.testing.conformance import check_scheduling_policy

from pagelm_fairshare import FairSharePolicy


def make_request(req_id, tenant, arrival, prompt_len=8, max_tokens=8):
    return Request(req_id, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), arrival_time=arrival, cache_salt=tenant)


def pop_all(queue):
    return [queue.pop().request_id for _ in range(len(queue))]


def test_conformance(tmp_path):
    check_scheduling_policy("fairshare", model_dir=build_tiny_model(tmp_path / "llama", "llama"))


def test_tenants_take_turns_whatever_the_arrival_order():
    queue = FairSharePolicy(EngineConfig(model="unused")).make_queue()
    for i in range(4):
        queue.add(make_request(f"a{i}", "a", arrival=i))
    for i in range(2):
        queue.add(make_request(f"b{i}", "b", arrival=10 + i))
    assert [r.request_id for r in queue] == ["a0", "b0", "a1", "b1", "a2", "a3"]
    assert pop_all(queue) == ["a0", "b0", "a1", "b1", "a2", "a3"]


def test_weights_give_a_tenant_a_larger_share():
    config = EngineConfig(model="unused", plugin_config={"fairshare": {"weights": {"a": 2.0}}})
    queue = FairSharePolicy(config).make_queue()
    for i in range(4):
        queue.add(make_request(f"a{i}", "a", arrival=i))
        queue.add(make_request(f"b{i}", "b", arrival=i + 0.5))
    # Equal-sized requests: "a" (weight 2) is charged half as much, so it gets two turns
    # for each of "b"'s once both are under way.
    assert pop_all(queue) == ["a0", "b0", "a1", "b1", "a2", "a3", "b2", "b3"]


def test_bad_weights_are_reported():
    config = EngineConfig(model="unused", plugin_config={"fairshare": {"weights": {"a": 0}}})
    assert FairSharePolicy.validate(config) == ["fairshare weights must be numbers > 0, got {'a': 0}"]
