"""``ray``: ranks 1..N-1 as Ray actors placed by a placement group, so they can live on other
nodes of a Ray cluster (vLLM's ``RayDistributedExecutor`` does the same). Install with
``pip install pagelm[ray]``.

The engine core (rank 0) joins the cluster that ``ray.init()`` finds: ``RAY_ADDRESS`` or a
running local head (``ray start --head``), else a fresh local one; a program may call
``ray.init(...)`` itself first. Each other rank is an actor holding one bundle of the
placement group (one GPU, or one CPU on a CPU engine). Rank 0's messages reach an actor as
method calls in order (numbered: the actor runs its worker loop in a thread of its own, so
calls may be picked up out of order, and the loop takes them by number). Ranks meet rank 0
in ``torch.distributed`` at this node's address.
"""

from __future__ import annotations

import threading
from typing import Any

from pagelm.executor import Executor, RankDiedError, describe_rank
from pagelm.worker.worker import run_worker

# Seconds the placement group may take to be placed (the cluster may be starting nodes).
_PLACEMENT_TIMEOUT = 300.0


class RayExecutor(Executor):
    name = "ray"

    def __init__(self, config) -> None:
        super().__init__(config)
        self._actors: list[Any] = []
        self._runs: list[Any] = []  # each actor's worker loop; ready = it has ended
        self._placement_group = None
        self._seq = 0

    @classmethod
    def validate(cls, config) -> list[str]:
        try:
            import ray  # noqa: F401
        except ImportError:
            return ["'ray' needs the ray package: pip install 'pagelm[ray]'"]
        return []

    def rendezvous_host(self) -> str:
        import ray

        self._init_ray()
        return ray.util.get_node_ip_address()

    def _init_ray(self) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, log_to_driver=True)

    def start(self, init_message: bytes, init_method: str) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._init_ray()
        world = self.config.world_size
        gpu = self.config.resolved_device().type == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        # PACK: on as few nodes as fit (a stage's tensor-parallel ranks on one host's GPUs).
        self._placement_group = placement_group([dict(bundle) for _ in range(1, world)], strategy="PACK")
        ready, _ = ray.wait([self._placement_group.ready()], timeout=_PLACEMENT_TIMEOUT)
        if not ready:
            self.shutdown()
            raise RuntimeError(
                f"Ray could not place {world - 1} ranks of {bundle} within {_PLACEMENT_TIMEOUT:.0f} s; "
                f"cluster resources: {ray.cluster_resources()}"
            )
        actor_cls = ray.remote(_RankActor)
        for rank in range(1, world):
            strategy = PlacementGroupSchedulingStrategy(self._placement_group, placement_group_bundle_index=rank - 1)
            actor = actor_cls.options(
                num_cpus=1, num_gpus=1 if gpu else 0, max_concurrency=2, scheduling_strategy=strategy
            ).remote()
            self._actors.append(actor)
            self._runs.append(actor.run.remote(init_message, rank, world, init_method, gpu))

    def send(self, message: bytes) -> None:
        self._raise_if_ended(wait=0)
        seq, self._seq = self._seq, self._seq + 1
        for actor in self._actors:
            actor.deliver.remote(seq, message)

    def check_ranks(self) -> None:
        self._raise_if_ended(wait=2.0)

    def _raise_if_ended(self, wait: float) -> None:
        import ray

        if not self._runs:
            return
        ended, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=wait)
        for ref in ended:
            rank = self._runs.index(ref) + 1
            try:
                ray.get(ref)
                why = "its worker loop ended"
            except Exception as exc:  # the actor died, or the worker raised
                why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            raise RankDiedError(f"{describe_rank(self.config, rank)} is not running ({why})")

    def shutdown(self) -> None:
        import ray

        if self._actors:
            seq = self._seq
            for actor in self._actors:
                actor.deliver.remote(seq, None)  # the loop reads EOF and returns
            ray.wait(self._runs, num_returns=len(self._runs), timeout=30)
            for actor in self._actors:
                ray.kill(actor)
        if self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement_group)
        self._actors, self._runs, self._placement_group = [], [], None


class _RankActor:
    """One rank: ``run`` serves the worker loop (in one of the actor's two threads) while
    ``deliver`` queues rank 0's messages (in the other)."""

    def __init__(self) -> None:
        self._messages: dict[int, bytes | None] = {}
        self._next = 0
        self._ready = threading.Condition()

    def deliver(self, seq: int, message: bytes | None) -> None:
        with self._ready:
            self._messages[seq] = message
            self._ready.notify()

    def _recv(self) -> bytes:
        with self._ready:
            self._ready.wait_for(lambda: self._next in self._messages)
            message = self._messages.pop(self._next)
            self._next += 1
        if message is None:
            raise EOFError
        return message

    def run(self, init_message: bytes, rank: int, world: int, init_method: str, gpu: bool) -> None:
        import torch

        # Ray shows the actor only its own GPU (CUDA_VISIBLE_DEVICES): it is cuda:0 here.
        device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        run_worker(init_message, rank, world, init_method, self._recv, device=device)
