"""The CPU tier's memory and copies on one rank.

The tier is one host tensor for all layers, block-major (``[num_blocks, num_layers, ...]``
whatever the GPU layout, so that a block is one contiguous run of bytes), pinned when the GPU
cache is on CUDA. On the CPU the two tiers are two tensors and the copies take the same path.

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


# What one batch of copies stages on the device at most (a run of blocks longer than this is
# split): the staging buffer is allocated per batch, outside the KV cache's memory budget.
STAGING_BYTES = 64 << 20


class CPUCopier(KVCopier):
    def __init__(self, num_blocks: int, kv_caches: list[torch.Tensor], block_dim: int) -> None:
        self.gpu_caches = kv_caches
        self.block_dim = block_dim
        self.device = kv_caches[0].device
        cuda = self.device.type == "cuda"
        layer_shape = tuple(n for d, n in enumerate(kv_caches[0].shape) if d != block_dim)
        for cache in kv_caches[1:]:
            if cache.dtype != kv_caches[0].dtype or tuple(n for d, n in enumerate(cache.shape) if d != block_dim) != layer_shape:
                raise ValueError("the CPU tier needs every layer's KV cache to have one shape and dtype")
        # One host tensor for every layer, block-major: a block's KV of all layers is one
        # contiguous run of bytes, so a run of consecutive tier blocks is one copy however
        # many layers there are (one copy per layer and block cost more host time than the
        # prefill a tier hit saves). Uninitialised: a tier block is read only after a copy
        # has written it.
        self.cpu_cache = torch.empty((num_blocks, len(kv_caches), *layer_shape), dtype=kv_caches[0].dtype, pin_memory=cuda)
        block_bytes = self.cpu_cache[0].numel() * self.cpu_cache.element_size()
        self.blocks_per_batch = max(1, STAGING_BYTES // block_bytes)
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
        """Each batch of blocks goes through a device staging buffer ``[blocks, layers, ...]``:
        one gather (or scatter) kernel per layer on the device side, one copy per run of
        consecutive tier blocks on the host side."""
        n = self.blocks_per_batch
        for i in range(0, len(transfers.swap_out), n):
            gpu_ids, cpu_ids = zip(*transfers.swap_out[i : i + n])
            src = self._index(gpu_ids)
            staged = torch.stack([c.index_select(self.block_dim, src).movedim(self.block_dim, 0) for c in self.gpu_caches], 1)
            for a, b, first in _runs(cpu_ids):
                self.cpu_cache[first : first + b - a].copy_(staged[a:b], non_blocking=True)
        for i in range(0, len(transfers.swap_in), n):
            cpu_ids, gpu_ids = zip(*transfers.swap_in[i : i + n])
            staged = torch.empty((len(cpu_ids), *self.cpu_cache.shape[1:]), dtype=self.cpu_cache.dtype, device=self.device)
            for a, b, first in _runs(cpu_ids):
                staged[a:b].copy_(self.cpu_cache[first : first + b - a], non_blocking=True)
            dst = self._index(gpu_ids)
            for layer, cache in enumerate(self.gpu_caches):
                cache.index_copy_(self.block_dim, dst, staged[:, layer].movedim(0, self.block_dim))

    def _index(self, ids) -> torch.Tensor:
        index = torch.tensor(ids, dtype=torch.long)
        if self.stream is None:
            return index
        return index.pin_memory().to(self.device, non_blocking=True)


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
