"""A policy whose waiting queue is a heap on a per-request rank (smaller first): the
shared shape of priority, SJF and any other "order by a key" policy."""

from __future__ import annotations

import heapq
import itertools
from abc import abstractmethod
from collections.abc import Iterator
from typing import Any

from pagelm.request import Request
from pagelm.sched.policy import SchedulingPolicy


class RankedQueuePolicy(SchedulingPolicy):
    """Subclasses define ``rank(request)``; a preempted request is pushed back under its
    rank, so it keeps its place instead of joining the back."""

    def __init__(self, config) -> None:
        super().__init__(config)
        # (rank, push counter, request): the counter keeps equal ranks in push order and stops
        # the heap from ever comparing two requests.
        self._heap: list[tuple[Any, int, Request]] = []
        self._counter = itertools.count()

    @abstractmethod
    def rank(self, request: Request) -> Any:
        """Smaller ranks are admitted first."""

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (self.rank(request), next(self._counter), request))

    def prepend(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        # Aborts while waiting are rare: O(n) is fine.
        self._heap = [e for e in self._heap if e[-1] is not request]
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[-1] for e in sorted(self._heap, key=lambda e: e[:2]))

    def __len__(self) -> int:
        return len(self._heap)

    def select_victim(self, running: list[Request]) -> Request:
        # The running request served last; among equals the newest (max keeps the first).
        return max(reversed(running), key=self.rank)
