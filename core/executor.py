"""The executor contract: how the ranks beside the engine core's own are started and reached.

Rank 0's model runner lives in the engine core's process, next to the scheduler; it is the
rank whose sampled ids the engine uses. An executor starts ranks ``1 .. world_size - 1``,
each running :func:`pagelm.worker.worker.run_worker` (its own model runner over its slice of
the weights), and delivers to each of them, in order, every message rank 0 sends: the
runner calls rank 0 makes (KV cache, graphs, each step's ``SchedulerOutput``), encoded with
msgpack by the core. The ranks' collectives then meet inside the model.

Executors are plugins (``pagelm_register_executors``) selected by
``distributed_executor_backend``: built in are ``uni`` (one rank, nothing to start),
``mp`` (local processes), ``ray`` (actors in a Ray placement group, across nodes) and
``external_launcher`` (every rank was started by an outside launcher, ``torchrun``, and
runs an engine core of its own: ``this_rank`` is not 0, nothing is started or sent).
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch

    from pagelm.config import EngineConfig


class RankDiedError(RuntimeError):
    """A rank is no longer running: no step can succeed until the ranks are started again
    (the core loop stops, its host reports the engine dead, ``AsyncLLM`` restarts it)."""


class Executor(ABC):
    name: ClassVar[str]
    # Every rank runs an engine core of its own (an outside launcher started them), and they
    # stay in step only by scheduling alike: the engine refuses requests whose scheduling
    # depends on timing (guided decoding) or whose results reach rank 0 alone (logprobs
    # under pipeline parallelism). False: rank 0's engine core drives the others.
    every_rank_schedules: ClassVar[bool] = False

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """Problems with running ``config`` on this executor (empty: none)."""
        return []

    def rendezvous_host(self) -> str:
        """The address of this host that the other ranks reach to join ``torch.distributed``
        (rank 0 listens there). Local executors keep the loopback; a multi-node one returns
        this node's address."""
        return "127.0.0.1"

    def this_rank(self) -> int:
        """The rank of the engine core's own process: 0 (it starts the others), unless an
        outside launcher started every rank, each with an engine core of its own."""
        return 0

    def this_device(self) -> "torch.device | None":
        """The device of the engine core's rank when the executor places it (an outside
        launcher: its local rank's GPU); None: the configured device."""
        return None

    def init_method(self) -> str:
        """Where the ranks meet in ``torch.distributed``: a free port of
        ``rendezvous_host()``, where rank 0 listens. Ignored when this process's
        ``torch.distributed`` is initialised already (the ranks adopt that world)."""
        host = self.rendezvous_host()
        with socket.socket() as s:  # free now; rank 0 binds it before the others connect
            s.bind((host, 0))
            return f"tcp://{host}:{s.getsockname()[1]}"

    @abstractmethod
    def start(self, init_message: bytes, init_method: str) -> None:
        """Start every other rank: ``run_worker(init_message, rank, world_size, init_method,
        recv)``, where ``recv()`` returns the next message for that rank (and raises
        ``EOFError`` once the executor is gone). Returns without waiting for them: they join
        rank 0 in ``torch.distributed`` at ``init_method``."""

    @abstractmethod
    def send(self, message: bytes) -> None:
        """Deliver ``message`` to every other rank, after the ones sent before; raise
        ``RankDiedError`` naming a rank that is no longer running."""

    def check_ranks(self) -> None:
        """Raise ``RankDiedError`` naming a rank that is no longer running (called after a
        step failed, to say whether a rank's death was why; waits briefly for a rank that
        is dying). Default: nothing known."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the other ranks (idempotent)."""


def describe_rank(config: EngineConfig, rank: int) -> str:
    """``rank 3 (tensor-parallel rank 1 of pipeline stage 1)``: how errors name a rank."""
    tp = config.tensor_parallel_size
    return f"rank {rank} (tensor-parallel rank {rank % tp} of pipeline stage {rank // tp})"
