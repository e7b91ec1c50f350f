"""The CPU tier's memory and copies on one rank.

The tier is one host tensor per layer, block-major (``[num_blocks, ...]`` whatever the GPU
layout, so that a block is one contiguous run of bytes), pinned when the GPU cache is on
CUDA. On the CPU the two tiers are two tensors and a copy is an ``index_copy_``.

On CUDA every copy runs on a side stream, in step order. A step's copies start once the
steps before it have been queued (they may still be writing the KV a swap-out reads), and
the forward pass waits for them only when it needs them::

    side stream:     |-- step N's swap-outs, swap-ins --|
    compute stream:  .. step N-1 ..|(wait, if N reads a swap-in or rewrites a block
                                      swapped out)| step N's forward ...

A swap-out whose GPU blocks step N does not rewrite overlaps step N's forward; the first
later step that allocates one of those blocks waits for it.
"""

from __future__ import annotations

import torch

from pagelm.kv_offload import KVCopier, KVTransfers
from pagelm.sched.output import SchedulerOutput


class CPUCopier(KVCopier):
    def __init__(self, num_blocks: int, kv_caches: list[torch.Tensor], block_dim: int) -> None:
        self.gpu_caches = kv_caches
        self.block_dim = block_dim
        self.device = kv_caches[0].device
        cuda = self.device.type == "cuda"
        self.cpu_caches = []
        for cache in kv_caches:
            shape = (num_blocks, *(n for d, n in enumerate(cache.shape) if d != block_dim))
            # Uninitialised: a tier block is read only after a copy has written it.
            self.cpu_caches.append(torch.empty(shape, dtype=cache.dtype, pin_memory=cuda))
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.copied = torch.cuda.Event() if cuda else None
        # GPU blocks read by queued swap-outs that no forward pass has waited for yet.
        self._unwaited: set[int] = set()

    def before_step(self, sched: SchedulerOutput) -> None:
        transfers = sched.kv_transfers
        if self.stream is None:
            if transfers:
                self._copy(transfers)
            return
        current = torch.cuda.current_stream(self.device)
        if transfers:
            self.stream.wait_stream(current)  # KV written by the steps queued before this one
            with torch.cuda.stream(self.stream):
                self._copy(transfers)
            self.copied.record(self.stream)
            self._unwaited.update(gpu for gpu, _ in transfers.swap_out)
            if transfers.swap_in:
                self._wait(current)
                return
        if self._unwaited and not self._unwaited.isdisjoint(_new_block_ids(sched)):
            self._wait(current)

    def _wait(self, stream: torch.cuda.Stream) -> None:
        stream.wait_event(self.copied)  # on the device: the host goes on
        self._unwaited.clear()

    def _copy(self, transfers: KVTransfers) -> None:
        if transfers.swap_out:
            gpu_ids, cpu_ids = zip(*transfers.swap_out)
            src = self._index(gpu_ids)
            for gpu, cpu in zip(self.gpu_caches, self.cpu_caches):
                self._to_host(gpu.index_select(self.block_dim, src).movedim(self.block_dim, 0), cpu, cpu_ids)
        if transfers.swap_in:
            cpu_ids, gpu_ids = zip(*transfers.swap_in)
            dst = self._index(gpu_ids)
            for gpu, cpu in zip(self.gpu_caches, self.cpu_caches):
                gpu.index_copy_(self.block_dim, dst, self._from_host(cpu, cpu_ids).movedim(0, self.block_dim))

    def _index(self, ids) -> torch.Tensor:
        index = torch.tensor(ids, dtype=torch.long)
        if self.stream is None:
            return index
        return index.pin_memory().to(self.device, non_blocking=True)

    def _to_host(self, blocks: torch.Tensor, cpu: torch.Tensor, cpu_ids) -> None:
        if self.stream is None:
            cpu.index_copy_(0, torch.tensor(cpu_ids, dtype=torch.long), blocks)
            return
        blocks = blocks.contiguous()
        for i, j, first in _runs(cpu_ids):  # one async copy per run of consecutive tier blocks
            cpu[first : first + j - i].copy_(blocks[i:j], non_blocking=True)

    def _from_host(self, cpu: torch.Tensor, cpu_ids) -> torch.Tensor:
        if self.stream is None:
            return cpu.index_select(0, torch.tensor(cpu_ids, dtype=torch.long))
        blocks = torch.empty((len(cpu_ids), *cpu.shape[1:]), dtype=cpu.dtype, device=self.device)
        for i, j, first in _runs(cpu_ids):
            blocks[i:j].copy_(cpu[first : first + j - i], non_blocking=True)
        return blocks


def _runs(ids) -> list[tuple[int, int, int]]:
    """``(i, j, first)``: ``ids[i:j]`` are ``first, first + 1, ...``."""
    out, i = [], 0
    for j in range(1, len(ids) + 1):
        if j == len(ids) or ids[j] != ids[j - 1] + 1:
            out.append((i, j, ids[i]))
            i = j
    return out


def _new_block_ids(sched: SchedulerOutput) -> set[int]:
    ids = {b for r in sched.scheduled_new_reqs for b in r.block_ids}
    ids.update(b for r in sched.scheduled_cached_reqs for b in r.new_block_ids)
    return ids
