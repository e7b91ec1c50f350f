"""The conformance kit passes on every built-in plugin, and fails, with a message that says
why, on plugins that break the contract."""

import pytest

from pagelm import hookimpl
from pagelm.backends.torch import TorchAttentionBackend
from pagelm.backends.torch.backend import TorchAttentionImpl
from pagelm.plugin_manager import get_plugin_manager
from pagelm.plugins.policies.fcfs import FCFSPolicy
from pagelm.sched.request_queue import FIFOQueue
from pagelm.testing.conformance import (
    check_attention_backend,
    check_attention_kernels,
    check_policy_queue,
    check_policy_scheduling,
    check_scheduling_policy,
)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "sjf"])
def test_builtin_policy_conforms(policy, llama_dir):
    check_scheduling_policy(policy, model_dir=llama_dir)


def test_torch_backend_conforms(llama_dir):
    check_attention_backend("torch", model_dir=llama_dir)


# ---- the kit catches broken plugins ---------------------------------------------------------


class ForgetfulQueue(FIFOQueue):
    def prepend(self, request):
        pass  # loses the request


class ForgetsPreempted(FCFSPolicy):
    name = "forgets_preempted"

    def make_queue(self):
        return ForgetfulQueue()


class BackToFrontQueue(FIFOQueue):
    def peek(self):
        return self._queue[-1]


class PeekIsNotPop(FCFSPolicy):
    name = "peek_is_not_pop"

    def make_queue(self):
        return BackToFrontQueue()


class ScaledImpl(TorchAttentionImpl):
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs) * 1.01


class OffByOnePercent(TorchAttentionBackend):
    name = "off_by_one_percent"

    @classmethod
    def make_impl(cls, spec):
        return ScaledImpl(spec)


class Broken:
    @hookimpl
    def pagelm_register_scheduling_policies(self, registry):
        registry.add(ForgetsPreempted.name, ForgetsPreempted)
        registry.add(PeekIsNotPop.name, PeekIsNotPop)

    @hookimpl
    def pagelm_register_attention_backends(self, registry):
        registry.add(OffByOnePercent.name, OffByOnePercent)


@pytest.fixture
def broken_plugins():
    get_plugin_manager().register(Broken(), name="broken-test-plugins")
    yield
    get_plugin_manager().unregister("broken-test-plugins")


def test_kit_catches_a_policy_that_loses_preempted_requests(broken_plugins):
    with pytest.raises(AssertionError, match="forgets_preempted: prepend"):
        check_policy_queue("forgets_preempted")
    with pytest.raises(AssertionError, match="forgets_preempted: requests did not finish"):
        check_policy_scheduling("forgets_preempted")


def test_kit_catches_a_policy_whose_peek_is_not_pop(broken_plugins):
    with pytest.raises(AssertionError, match="peek_is_not_pop: peek"):
        check_policy_queue("peek_is_not_pop")


def test_kit_catches_a_backend_that_differs_from_the_reference(broken_plugins):
    with pytest.raises(AssertionError, match="off_by_one_percent: attention differs from 'torch'"):
        check_attention_kernels("off_by_one_percent")
