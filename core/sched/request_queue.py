"""The waiting queue's contract (``RequestQueue``) and the two shapes policies build on: a
FIFO deque and a heap on a per-request rank.

``Scheduler.waiting`` is the queue its policy makes (``SchedulingPolicy.make_queue``); the
scheduler admits from its head and puts preempted requests back with ``prepend``.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagelm.request import Request


class RequestQueue(ABC):
    """Waiting requests in admission order."""

    @abstractmethod
    def add(self, request: "Request") -> None:
        """A new request arrives."""

    @abstractmethod
    def prepend(self, request: "Request") -> None:
        """A preempted request comes back; it should not lose its place to newer arrivals."""

    @abstractmethod
    def peek(self) -> "Request":
        """The next request to admit (the queue is not empty)."""

    @abstractmethod
    def pop(self) -> "Request":
        """Remove and return what ``peek`` returns."""

    @abstractmethod
    def remove(self, request: "Request") -> None:
        """Drop a request (aborted while waiting)."""

    @abstractmethod
    def __iter__(self) -> Iterator["Request"]:
        """Waiting requests in admission order."""

    @abstractmethod
    def __len__(self) -> int: ...


class FIFOQueue(RequestQueue):
    """Arrival order; a preempted request goes back to the head."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: "Request") -> None:
        self._queue.append(request)

    def prepend(self, request: "Request") -> None:
        self._queue.appendleft(request)

    def peek(self) -> "Request":
        return self._queue[0]

    def pop(self) -> "Request":
        return self._queue.popleft()

    def remove(self, request: "Request") -> None:
        self._queue.remove(request)

    def __iter__(self) -> Iterator["Request"]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)


class RankedQueue(RequestQueue):
    """A heap on ``rank(request)``, smaller first; a preempted request is pushed back under
    its rank, so it keeps its place instead of joining the back."""

    def __init__(self, rank: Callable[["Request"], Any]) -> None:
        self.rank = rank
        # (rank, push counter, request): the counter keeps equal ranks in push order and stops
        # the heap from ever comparing two requests.
        self._heap: list[tuple[Any, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: "Request") -> None:
        heapq.heappush(self._heap, (self.rank(request), next(self._counter), request))

    def prepend(self, request: "Request") -> None:
        self.add(request)

    def peek(self) -> "Request":
        return self._heap[0][-1]

    def pop(self) -> "Request":
        return heapq.heappop(self._heap)[-1]

    def remove(self, request: "Request") -> None:
        # Aborts while waiting are rare: O(n) is fine.
        self._heap = [e for e in self._heap if e[-1] is not request]
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator["Request"]:
        return (e[-1] for e in sorted(self._heap, key=lambda e: e[:2]))

    def __len__(self) -> int:
        return len(self._heap)
