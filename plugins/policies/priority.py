"""Priority scheduling: lower ``priority`` value first, ties by arrival (a heap on
``(priority, arrival_time)``).

A waiting request preempts the lowest-ranked running request when there is no room for it
(KV blocks or ``max_num_seqs``) and its priority value is strictly lower; equal priorities
never preempt each other, so ties cost no recomputation. A preempted request goes back under
its original key, so it keeps its place by priority rather than joining the back.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from pagelm import hookimpl
from pagelm.request import Request
from pagelm.sched.policy import SchedulingPolicy

PAGELM_PLUGIN_API = "1.0"


class PriorityPolicy(SchedulingPolicy):
    name = "priority"

    def __init__(self, config) -> None:
        super().__init__(config)
        # (priority, arrival_time, push counter, request): the counter only keeps equal keys
        # in push order and stops the heap from ever comparing two requests.
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    @staticmethod
    def rank(request: Request) -> tuple[int, float]:
        """Smaller ranks first."""
        return (request.priority, request.arrival_time)

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (*self.rank(request), next(self._counter), request))

    def prepend(self, request: Request) -> None:
        self.add(request)  # same key as on arrival: it keeps its place by priority

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        # Aborts while waiting are rare: O(n) is fine.
        self._heap = [e for e in self._heap if e[-1] is not request]
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[-1] for e in sorted(self._heap, key=lambda e: e[:3]))

    def __len__(self) -> int:
        return len(self._heap)

    def select_victim(self, running: list[Request]) -> Request:
        # Worst rank; among equals the newest admitted (reversed: max keeps the first maximum).
        return max(reversed(running), key=self.rank)

    def select_victim_for(self, request: Request, running: list[Request]) -> Request | None:
        if not running:
            return None
        victim = self.select_victim(running)
        return victim if victim.priority > request.priority else None


@hookimpl
def pagelm_register_scheduling_policies(registry) -> None:
    registry.add(PriorityPolicy.name, PriorityPolicy)
