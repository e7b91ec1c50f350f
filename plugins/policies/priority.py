"""Priority scheduling: lower ``priority`` value first, ties by arrival (a heap on
``(priority, arrival_time)``).

A waiting request preempts the lowest-ranked running request when there is no room for it
(KV blocks or ``max_num_seqs``) and its priority value is strictly lower; equal priorities
never preempt each other, so ties cost no recomputation. A preempted request goes back under
its original key, so it keeps its place by priority rather than joining the back.
"""

from __future__ import annotations

from pagelm import hookimpl
from pagelm.request import Request
from pagelm.sched.policy import SchedulingPolicy

PAGELM_PLUGIN_API = "2.25"


class PriorityPolicy(SchedulingPolicy):
    name = "priority"

    def rank(self, request: Request) -> tuple[int, float]:
        return (request.priority, request.arrival_time)

    def select_victim_for(self, request: Request, running: list[Request]) -> Request | None:
        if not running:
            return None
        victim = self.select_victim(running)
        return victim if victim.priority > request.priority else None


@hookimpl
def pagelm_register_scheduling_policies(registry) -> None:
    registry.add(PriorityPolicy.name, PriorityPolicy)
