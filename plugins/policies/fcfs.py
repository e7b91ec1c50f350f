"""First come, first served: a deque in arrival order; the newest running request is the
one preempted (it has the least work to lose)."""

from __future__ import annotations

from pagelm import hookimpl
from pagelm.request import Request
from pagelm.sched.policy import SchedulingPolicy
from pagelm.sched.request_queue import FIFOQueue, RequestQueue

PAGELM_PLUGIN_API = "2.25"


class FCFSPolicy(SchedulingPolicy):
    name = "fcfs"

    def rank(self, request: Request) -> float:
        return request.arrival_time

    def make_queue(self) -> RequestQueue:
        return FIFOQueue()

    def select_victim(self, running: list[Request]) -> Request:
        return running[-1]


@hookimpl
def pagelm_register_scheduling_policies(registry) -> None:
    registry.add(FCFSPolicy.name, FCFSPolicy)
