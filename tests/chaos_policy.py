"""``chaos``: a scheduling policy for the randomized tests. FCFS order, but victims at random:
any running request when KV is short, and half the time a running request for the waiting
head (equal rank or not), seeded by ``plugin_config["chaos_seed"]``. A test module takes
the ``chaos_policy`` fixture (``from chaos_policy import chaos_policy``) to have it
registered while it runs."""

from __future__ import annotations

import random

import pytest

from pagelm import hookimpl
from pagelm.plugin_manager import get_plugin_manager
from pagelm.plugins.policies.fcfs import FCFSPolicy
from pagelm.request import Request


class ChaosPolicy(FCFSPolicy):
    name = "chaos"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.rng = random.Random(config.plugin_config.get("chaos_seed", 0))

    def select_victim(self, running: list[Request]) -> Request:
        return self.rng.choice(running)

    def select_victim_for(self, request: Request, running: list[Request]) -> Request | None:
        return self.rng.choice(running) if running and self.rng.random() < 0.5 else None


class _ChaosPlugin:
    @hookimpl
    def pagelm_register_scheduling_policies(self, registry) -> None:
        registry.add(ChaosPolicy.name, ChaosPolicy)


@pytest.fixture(scope="module", autouse=True)
def chaos_policy():
    get_plugin_manager().register(_ChaosPlugin(), name="test-chaos-policy")
    yield
    get_plugin_manager().unregister(name="test-chaos-policy")
