"""Tensor-parallel state: which rank this process is, of how many, and the collectives the
parallel layers call (``pagelm.models.parallel``).

One process per rank. Rank 0 runs the engine core (scheduler, KV cache manager and its own
model runner); an executor (``pagelm.executor``) starts the others. Every rank holds the
same config and runs the same runner calls in the same order, so its collectives meet the
others' inside the model. Collectives go through ``torch.distributed``: NCCL on CUDA, gloo
on the CPU (how CI tests tensor parallelism). With one rank nothing is initialised and the
collectives return their input.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1


_state = ParallelState()


def parallel_state() -> ParallelState:
    return _state


def init_distributed(rank: int, world_size: int, init_method: str, device: torch.device, timeout: float) -> None:
    """Join the ranks' process group (blocks until all ``world_size`` have joined); a
    collective waiting longer than ``timeout`` seconds raises."""
    global _state
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":  # a bare "cuda" (rank 0's default) is the current device
            torch.cuda.set_device(device if device.index is not None else torch.cuda.current_device())
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
    _state = ParallelState(tp_rank=rank, tp_size=world_size)


def destroy_distributed() -> None:
    global _state
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = ParallelState()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks, in place."""
    if _state.tp_size > 1:
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' ``x`` concatenated along ``dim``, in rank order."""
    if _state.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.tp_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
