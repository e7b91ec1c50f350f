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


def drive(engine, pending: list, add, max_steps: int, case) -> tuple[dict[str, list[int]], set[str]]:
    """Step ``engine`` until idle, adding each ``(i, r)`` of ``pending`` (in arrival order) at
    step ``r["arrival"]`` with ``add(i, r)`` and aborting it ``r["abort_at"]`` steps later
    (None: never). Returns the finished requests' greedy tokens and the aborted ids."""
    finished: dict[str, list[int]] = {}
    aborted: set[str] = set()
    live: dict[str, int] = {}  # req_id -> the step at which it is aborted
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1]["arrival"] <= step:
            i, r = pending.pop(0)
            add(i, r)
            if r["abort_at"] is not None:
                live[str(i)] = step + r["abort_at"]
        for req_id, when in list(live.items()):
            if when <= step and req_id not in finished:
                engine.abort_request([req_id])
                aborted.add(req_id)
                del live[req_id]
        for out in engine.step():
            if out.finished and out.request_id not in aborted:
                finished[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
        assert step < max_steps, f"the engine made no progress in {max_steps} steps: {case}"
    return finished, aborted
