"""First come, first served: a deque in arrival order; the newest running request is the
one preempted (it has the least work to lose)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from pagelm import hookimpl
from pagelm.request import Request
from pagelm.sched.policy import SchedulingPolicy

PAGELM_PLUGIN_API = "1.0"


class FCFSPolicy(SchedulingPolicy):
    name = "fcfs"

    def __init__(self, config) -> None:
        super().__init__(config)
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def select_victim(self, running: list[Request]) -> Request:
        return running[-1]


@hookimpl
def pagelm_register_scheduling_policies(registry) -> None:
    registry.add(FCFSPolicy.name, FCFSPolicy)
