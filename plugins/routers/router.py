"""The data-parallel router contract: which of the ``data_parallel_size`` engine replicas
serves a new request (once per request, seeing each replica's load; a request stays on its
replica). Selected by ``data_parallel_router``; docs/plugins.md, ``pagelm_register_routers``.
A plugin kind of the ``routers`` plugin, which adds the hook below to the plugin manager (the
data-parallel plugin asks it for the router that ``data_parallel_router`` names).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import pluggy

if TYPE_CHECKING:
    from pagelm.config import EngineConfig
    from pagelm.registry import Registry
    from pagelm.request import Request


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router sees of one replica: the requests it holds that have not finished."""

    num_unfinished: int
    # Prompt tokens of those requests not yet through prefill (a rough measure of queued work).
    num_pending_prompt_tokens: int


class Router(ABC):
    name: ClassVar[str]

    def __init__(self, config: EngineConfig, num_replicas: int) -> None:
        self.config = config
        self.num_replicas = num_replicas

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """Problems with routing ``config`` (empty: none)."""
        return []

    @abstractmethod
    def route(self, request: Request, loads: Sequence[ReplicaLoad]) -> int:
        """The index (``0 .. num_replicas - 1``) of the replica that will serve ``request``.
        Called once per request, in the API process, before it is queued."""

    def request_finished(self, request_id: str, replica: int) -> None:
        """``request_id`` has left ``replica`` (finished, aborted or failed). Optional."""


@pluggy.HookspecMarker("pagelm")
def pagelm_register_routers(registry: "Registry") -> None:
    """Add data-parallel ``Router`` subclasses: ``registry.add(name, router_cls)``. The name is
    what ``data_parallel_router=`` selects."""
