"""The KV-offload contract: a second tier of KV cache blocks (host memory) behind the GPU pool,
for swap preemption and prefix spill (``docs/kv_offload.md``).

The scheduler's side, :class:`KVOffloadTier`, is block bookkeeping only (which tier block
holds what); every copy it decides is written into the step's ``SchedulerOutput.kv_transfers``
(:class:`KVTransfers`, plain data) and run by each rank's :class:`KVCopier` before that step's
forward pass. A plugin registers a :class:`KVOffload` (``pagelm_register_kv_offload``; the
built-in one is ``cpu``), which makes both. With ``swap_space=0`` none of this exists.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from pagelm.sched.output import KVTransfers, SchedulerOutput

if TYPE_CHECKING:
    import torch

    from pagelm.config import EngineConfig
    from pagelm.kv_cache.block_hash import BlockHash
    from pagelm.request import Request

__all__ = ["KVCopier", "KVOffload", "KVOffloadStats", "KVOffloadTier", "KVTransfers"]


@dataclass(slots=True)
class KVOffloadStats:
    """The tier's state and its totals since start (the metrics read them once per step)."""

    num_blocks: int = 0
    num_free_blocks: int = 0
    block_bytes: int = 0
    blocks_swapped_out: int = 0  # GPU -> tier copies (swap preemption and spill)
    blocks_swapped_in: int = 0  # tier -> GPU copies (resumes and prefix hits)
    num_swap_preemptions: int = 0  # victims swapped out (the others were recomputed)
    hit_blocks: int = 0  # prefix-cache blocks found in the tier and copied back
    num_swapped_requests: int = 0  # preempted requests whose KV waits in the tier now

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


class KVOffloadTier(ABC):
    """The scheduler's view of the tier: which tier block holds which KV, and the copies that
    follow from its decisions. Called by ``KVCacheManager``, in the scheduler's thread: inside
    ``schedule()``, and ``free`` when a request ends."""

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Tier blocks nobody holds (cached ones included: they are evicted LRU first)."""

    @abstractmethod
    def count_hits(self, block_hashes: Sequence["BlockHash"]) -> int:
        """How many of ``block_hashes``, from the first, the tier holds (stops at a miss)."""

    @abstractmethod
    def num_swapped_tokens(self, request_id: str) -> int:
        """Tokens of ``request_id`` swapped out and not yet back (0: none)."""

    @abstractmethod
    def swap_out(self, request_id: str, blocks: Sequence, num_tokens: int, force: bool) -> bool:
        """Keep the KV of a preempted request's first ``num_tokens`` tokens, held by the GPU
        ``blocks`` (``KVCacheBlock``s, as many as those tokens fill), in the tier. ``force``
        (``preemption_mode="swap"``): whenever there is room; otherwise only when copying
        is cheaper than recomputing. False: nothing changed (the scheduler recomputes)."""

    @abstractmethod
    def load(self, request: "Request", start_block: int, block_ids: Sequence[int]) -> None:
        """Copy tier KV into the GPU blocks ``block_ids``: a swapped-out request's own blocks
        (``start_block`` 0; the tier lets go of them), or else the prefix-cache blocks of
        ``request.block_hashes[start_block:]`` that ``count_hits`` found. The copies join
        ``swap_in`` in the order of these calls, one pair per block of ``block_ids``: the
        manager names the request of each run of them (``KVTransfers.loads``)."""

    @abstractmethod
    def spill(self, block_id: int, block_hash: "BlockHash") -> None:
        """The GPU pool is evicting prefix-cache block ``block_id`` to reuse it: keep its KV
        under ``block_hash`` if there is room (the copy runs before the block is rewritten)."""

    def loads_landed(self, request_ids: Sequence[str]) -> None:
        """The runner reports these requests' loads landed (``ModelRunnerOutput.finished_loads``;
        a request aborted while loading is reported too): the tier blocks they read may be
        reused. Added in 2.18; the default does nothing, for a tier that lets go of a load's
        sources once its step's copies are queued (right only with a copier that runs a
        step's copies in order before anything later)."""

    @abstractmethod
    def free(self, request_id: str) -> None:
        """``request_id`` left the engine (finished, aborted, failed): drop its swapped blocks."""

    @abstractmethod
    def take_transfers(self) -> KVTransfers | None:
        """The copies decided since the last call (None: none), once per ``schedule()``."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every cached block (a step failed; its copies may not have run)."""

    @abstractmethod
    def stats(self) -> KVOffloadStats:
        """The tier's state and totals now."""


class KVCopier(ABC):
    """One rank's side of the tier: the tier's memory and the copies."""

    @abstractmethod
    def before_step(self, sched: SchedulerOutput) -> None:
        """Called by the model runner before it queues ``sched``'s forward pass (every step,
        while a tier exists): queue ``sched.kv_transfers`` and make the forward pass wait
        for the copies it depends on: swap-outs of blocks it rewrites, and the loads of the
        requests in ``kv_transfers.waits``. The loads queued now (``kv_transfers.loads``)
        should not hold this step up: ``finished_loads`` reports them once they land."""

    def finished_loads(self, wait: bool) -> list[str] | None:
        """The requests whose loads (``KVTransfers.loads``) have landed since the last call,
        in the order they were queued; the first rank's answer goes to the scheduler, which
        then schedules them. ``wait``: the step had nothing to compute, so block until the
        oldest pending load lands rather than return nothing (the engine would spin).

        None, the default (a copier written for plugin API 2.17, whose forward pass waits for
        the swap-ins it queues): the loads of the step just finished are done."""
        return None


class KVOffload(ABC):
    """What a plugin registers: the tier's two halves for one engine."""

    name: ClassVar[str]

    @classmethod
    def validate(cls, config: "EngineConfig") -> list[str]:
        """Problems with running ``config`` with this tier (empty: none)."""
        return []

    @classmethod
    @abstractmethod
    def make_tier(
        cls, config: "EngineConfig", num_blocks: int, block_bytes: int, flops_per_token: float
    ) -> KVOffloadTier:
        """The scheduler's side, with ``num_blocks`` tier blocks of ``block_bytes`` each (one
        rank's share); ``flops_per_token``: what computing one token's forward pass costs
        (``preemption_mode="auto"`` weighs recomputing against copying)."""

    @classmethod
    @abstractmethod
    def make_copier(
        cls, config: "EngineConfig", num_blocks: int, kv_caches: list["torch.Tensor"], block_dim: int
    ) -> KVCopier:
        """One rank's side: ``num_blocks`` tier blocks shaped like ``kv_caches`` (every layer's
        GPU cache, whose dimension ``block_dim`` indexes blocks)."""
