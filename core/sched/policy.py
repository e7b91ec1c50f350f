"""The scheduling-policy contract: the shape of the waiting queue and who gets preempted.

The scheduler owns the mechanism (token budget, KV allocation, chunking, preemption); a
policy only decides order and who gives way. Built-in and third-party policies register
through ``pagelm_register_scheduling_policies`` and are chosen with ``scheduling_policy=<name>``.

Two preemption questions reach the policy:

* ``select_victim(running)``: a *running* request needs KV slots and the pool is full; which
  running request is preempted (it may be the one asking).
* ``select_victim_for(request, running)``: the *waiting* head cannot be admitted (no KV room,
  or ``max_num_seqs`` running); return a running request to preempt in its favour, or None to
  let it wait. The default is None (no running request is ever preempted for a waiting one).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from pagelm.config import EngineConfig
    from pagelm.request import Request


class SchedulingPolicy(ABC):
    """A queue of waiting requests in admission order, plus the victim rule."""

    name: ClassVar[str]

    def __init__(self, config: "EngineConfig") -> None:
        self.config = config

    @classmethod
    def validate(cls, config: "EngineConfig") -> list[str]:
        """Problems with ``config`` for this policy (empty list: fine)."""
        return []

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

    @abstractmethod
    def select_victim(self, running: list["Request"]) -> "Request":
        """Which running request to preempt when the KV pool is full (``running`` is in
        admission order and not empty)."""

    def select_victim_for(self, request: "Request", running: list["Request"]) -> "Request | None":
        """``request`` (the head of the queue) cannot be admitted for lack of KV blocks or
        because ``max_num_seqs`` requests run: a running request to preempt for it, or None
        to wait. The scheduler asks again after each preemption until the request fits or
        this returns None, so a victim must rank strictly below ``request`` or the two could
        displace each other forever."""
        return None
