"""The scheduling-policy contract: the shape of the waiting queue and who gets preempted.

The scheduler owns the mechanism (token budget, KV allocation, chunking); a policy only
decides order. Built-in and third-party policies register through
``pagelm_register_scheduling_policies`` and are chosen with ``scheduling_policy=<name>``.
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
