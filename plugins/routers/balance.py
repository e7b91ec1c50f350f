"""Load-balancing routers that ignore what a request says: ``round_robin`` (replicas in
turn) and ``least_loaded`` (the replica holding the fewest unfinished requests, then the
least prompt work not yet prefilled, then the lowest index)."""

from __future__ import annotations

from collections.abc import Sequence

from pagelm.plugins.routers.router import ReplicaLoad, Router


class RoundRobinRouter(Router):
    name = "round_robin"

    def __init__(self, config, num_replicas: int) -> None:
        super().__init__(config, num_replicas)
        self._next = 0

    def route(self, request, loads: Sequence[ReplicaLoad]) -> int:
        i, self._next = self._next, (self._next + 1) % self.num_replicas
        return i


def least_loaded(loads: Sequence[ReplicaLoad], among: Sequence[int] | None = None) -> int:
    candidates = range(len(loads)) if among is None else among
    return min(candidates, key=lambda i: (loads[i].num_unfinished, loads[i].num_pending_prompt_tokens, i))


class LeastLoadedRouter(Router):
    name = "least_loaded"

    def route(self, request, loads: Sequence[ReplicaLoad]) -> int:
        return least_loaded(loads)
