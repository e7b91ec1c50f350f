"""The scheduling-policy contract (version 2): who goes first and who gives way.

The scheduler owns the mechanism (token budget, KV allocation, chunking, preemption, the
progress guarantee); a policy only orders the waiting queue it makes (``make_queue``, by
default a heap on ``rank``) and picks preemption victims. Built-in and third-party policies
register through ``pagelm_register_scheduling_policies``; ``docs/plugins.md`` has the guide
and the migration note from version 1 (where the policy *was* the queue).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from pagelm.sched.request_queue import RankedQueue, RequestQueue

if TYPE_CHECKING:
    from pagelm.config import EngineConfig
    from pagelm.request import Request


class SchedulingPolicy(ABC):
    """Ranks requests, makes the waiting queue and picks preemption victims."""

    name: ClassVar[str]

    def __init__(self, config: "EngineConfig") -> None:
        self.config = config

    @classmethod
    def validate(cls, config: "EngineConfig") -> list[str]:
        """Problems with ``config`` for this policy (empty list: fine)."""
        return []

    @abstractmethod
    def rank(self, request: "Request") -> Any:
        """A sort key: smaller ranks are admitted first and preempted last."""

    def make_queue(self) -> RequestQueue:
        """The scheduler's waiting queue, made once per engine. Default: a heap on ``rank``
        (which is read once, when a request is queued)."""
        return RankedQueue(self.rank)

    def select_victim(self, running: list["Request"]) -> "Request":
        """Which running request to preempt when the KV pool is full (``running`` is in
        admission order and not empty). Default: the one ranked last, among equals the one
        admitted last."""
        return max(reversed(running), key=self.rank)

    def select_victim_for(self, request: "Request", running: list["Request"]) -> "Request | None":
        """``request`` (the head of the queue) cannot be admitted for lack of KV blocks or
        because ``max_num_seqs`` requests run: a running request to preempt for it, or None
        to wait. The scheduler asks again after each preemption until the request fits or
        this returns None. A victim should rank strictly below ``request``: two requests that
        displace each other only progress because the scheduler stops offering a request
        preempted ``max_stalled_preemptions`` times without a token."""
        return None
