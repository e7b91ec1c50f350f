"""A small all-reduce in one kernel over torch's symmetric memory (the ``one_shot_all_reduce``
kernel, which ``pagelm.distributed.all_reduce`` asks for on CUDA with tensor parallelism
unless ``disable_custom_all_reduce``): each rank copies its input into a buffer every rank
can read over NVLink, then sums all the buffers. 8.6 us against NCCL's 14.7 us per 8 KiB
inside a CUDA graph on two H100s, with 64 of them per Llama-8B decode step
(docs/benchmarks.md, issue 18)."""

from __future__ import annotations

import logging
import warnings

import torch

logger = logging.getLogger(__name__)

# All-reduces of at most this many bytes take this path (above it NCCL's bandwidth wins or
# the gain is small: 37 against 41 us at 4 MiB).
SYMM_MEM_MAX_BYTES = 512 * 1024
# Marks, in the caller's buffers, a group without symmetric memory.
_UNAVAILABLE = "unavailable"


def one_shot_all_reduce(x: torch.Tensor, group_name: str, buffers: dict) -> torch.Tensor | None:
    """The sum of ``x`` over process group ``group_name``'s ranks, as a new tensor; None where
    this path does not serve ``x`` (too large, not contiguous, or no symmetric memory here),
    and the caller uses NCCL. ``buffers`` is the caller's, kept for this group and dropped
    with it: dtype -> this rank's buffer. The first call of each dtype is a collective (every
    rank reaches it at the same all-reduce: the eager profiling step, before any CUDA graph
    is captured)."""
    if _UNAVAILABLE in buffers or x.numel() * x.element_size() > SYMM_MEM_MAX_BYTES or not x.is_contiguous():
        return None
    buffer = buffers.get(x.dtype)
    if buffer is None:
        buffer = _make_buffer(x.dtype, x.device, group_name)
        if buffer is None:
            buffers[_UNAVAILABLE] = True
            return None
        buffers[x.dtype] = buffer
    # One kernel: x is copied into this rank's buffer, then every rank sums all buffers.
    return torch.ops.symm_mem.one_shot_all_reduce_copy(buffer[: x.numel()].view_as(x), x, "sum", group_name)


def _make_buffer(dtype: torch.dtype, device: torch.device, group_name: str) -> torch.Tensor | None:
    """This rank's buffer for ``dtype``, made and exchanged with the group's other ranks; None
    (NCCL from then on) where this torch or machine has no symmetric memory."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9
                symm_mem.enable_symm_mem_for_group(group_name)
            buffer = symm_mem.empty(SYMM_MEM_MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
            symm_mem.rendezvous(buffer, group_name)
    except Exception as e:  # an old torch, no P2P between the GPUs: NCCL serves every size
        logger.warning("symmetric-memory all-reduce unavailable (%s); NCCL for every all-reduce", e)
        return None
    return buffer
