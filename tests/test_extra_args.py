"""``SamplingParams.extra_args``: per-request data a plugin reads, offline, across the engine
core's wire, and from the server's request body."""

import pytest

from pagelm import LLM, SamplingParams, hookimpl
from pagelm.engine.core_loop import decode_request, encode_request
from pagelm.plugin_manager import get_plugin_manager
from pagelm.request import Request
from pagelm.sched.policy import SchedulingPolicy


class EarliestDeadlineFirst(SchedulingPolicy):
    """Reads each request's deadline from ``extra_args`` (what a user's EDF plugin does)."""

    name = "edf_test"

    def rank(self, request):
        return (request.sampling_params.extra_args or {}).get("deadline_ms", float("inf"))


class _Plugin:
    @hookimpl
    def pagelm_register_scheduling_policies(self, registry):
        registry.add(EarliestDeadlineFirst.name, EarliestDeadlineFirst)


@pytest.fixture
def edf():
    get_plugin_manager().register(_Plugin(), name="test-extra-args")
    yield
    get_plugin_manager().unregister("test-extra-args")


def test_a_policy_orders_requests_by_their_extra_args(llama_dir, edf):
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", scheduling_policy="edf_test", max_num_seqs=1)
    deadlines = [300, 100, 200]  # arrival order 0, 1, 2
    params = [SamplingParams(max_tokens=2, extra_args={"deadline_ms": d}) for d in deadlines]
    outs = llm.generate([{"prompt_token_ids": [5 + i, 6]} for i in range(3)], params, use_tqdm=False)
    served = sorted(range(3), key=lambda i: outs[i].metrics.first_token_time)
    assert served == [1, 2, 0]


def test_extra_args_cross_the_engine_core_wire():
    params = SamplingParams(max_tokens=3, extra_args={"deadline_ms": 120, "tags": ["a", "b"], "nested": {"x": 1.5}})
    decoded = decode_request(encode_request(Request("r", [1, 2], params)))
    assert decoded.sampling_params.extra_args == {"deadline_ms": 120, "tags": ["a", "b"], "nested": {"x": 1.5}}


@pytest.mark.parametrize("bad", [["not", "a", "dict"], {1: "int key"}, {"fn": print}])
def test_extra_args_must_be_a_json_dict(bad):
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args=bad)
