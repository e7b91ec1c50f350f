"""The CPU tier's memory and copies on one rank.

The tier is one host tensor for all layers, block-major (``[num_blocks, num_layers, ...]``
whatever the GPU layout, so that a block is one contiguous run of bytes), pinned when the GPU
cache is on CUDA. On the CPU the two tiers are two tensors and the copies take the same path.

On CUDA the copies run on two side streams of the highest priority, each in step order:
swap-outs (GPU -> tier) on one, loads (tier -> GPU) on the other, so that a step's spills
never queue behind other requests' loads. The forward pass waits for them only where it
needs them::

    out stream:      |- step N's swap-outs -|              |- N+1's -|
    load stream:          (after N's swap-outs) |-- load A --|-- load B --|
    compute stream:  .. N-1 ..|(wait if N rewrites a block swapped out)| step N | N+1 ...
                                            ... step M (waits: A) |(wait A)| A's prefill

A swap-out whose GPU blocks step N does not rewrite overlaps step N's forward; the first
later step that allocates one of those blocks waits for it. A load (a request's blocks read
back from the tier) holds no step up: each request's load records an event, polled by
``finished_loads``; the scheduler schedules the request once it is reported, and names it in
that step's ``waits``, whose forward pass (and later swap-outs) then wait for the event on
every rank (a no-op on the first rank, which reported it; another rank's copy may lag).

Ordering between the two: a load starts after the swap-outs queued before it (it may read a
tier block one writes, or write a GPU block one reads, in the same step); a swap-out never
overwrites a tier block a queued load reads (the tier holds a load's sources until it is
reported landed, and the swap-outs after that wait for the load's event).
"""

from __future__ import annotations

from collections import deque

import torch

from pagelm.kv_offload import KVCopier, KVTransfers
from pagelm.sched.output import SchedulerOutput
from pagelm.worker.step_state import host_sync_point


# What one batch of copies stages on the device at most (a run of blocks longer than this is
# split): the staging buffer is allocated per batch, outside the KV cache's memory budget.
# Each batch costs a gather or scatter kernel per layer: at 64 MiB (32 blocks of an 8B model)
# queueing a chat turn's 119-block load took the host milliseconds.
STAGING_BYTES = 256 << 20


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
        # Highest priority: with the default, a load's scatter kernels waited behind the
        # forward passes, and turns waited a second for loads of a few milliseconds.
        priority = min(torch.cuda.Stream.priority_range()) if cuda else 0
        self.stream = torch.cuda.Stream(self.device, priority=priority) if cuda else None
        self.load_stream = torch.cuda.Stream(self.device, priority=priority) if cuda else None
        self.copied = torch.cuda.Event() if cuda else None  # after the last step's swap-outs
        # GPU blocks read by queued swap-outs that no forward pass has waited for yet.
        self._unwaited: set[int] = set()
        # Loads: not yet reported (in queue order), and not yet waited for by a forward pass.
        self._pending: deque[tuple[str, torch.cuda.Event | None]] = deque()
        self._load_events: dict[str, torch.cuda.Event] = {}

    def before_step(self, sched: SchedulerOutput) -> None:
        transfers = sched.kv_transfers
        if self.stream is None:  # the CPU: copies are done when queued
            if transfers:
                self._copy_out(transfers.swap_out)
                self._copy_in(transfers)
            return
        current = torch.cuda.current_stream(self.device)
        if transfers:
            for req_id in transfers.waits:
                event = self._load_events.pop(req_id, None)
                if event is not None:  # on the device: the host goes on
                    current.wait_event(event)
                    self.stream.wait_event(event)  # its sources and blocks may be reused now
            if transfers.swap_out:
                self.stream.wait_stream(current)  # KV written by the steps queued before this one
                with torch.cuda.stream(self.stream):
                    self._copy_out(transfers.swap_out)
                self.copied.record(self.stream)
                self._unwaited.update(gpu for gpu, _ in transfers.swap_out)
            if transfers.swap_in:
                self.load_stream.wait_stream(current)  # its blocks' last writers, in flight
                self.load_stream.wait_stream(self.stream)  # swap-outs queued before it
                with torch.cuda.stream(self.load_stream):
                    unnamed = self._copy_in(transfers)
                if unnamed:  # swap-ins no load names: this step reads them
                    current.wait_stream(self.load_stream)
        if self._unwaited and not self._unwaited.isdisjoint(_new_block_ids(sched)):
            current.wait_event(self.copied)
            self._unwaited.clear()

    def finished_loads(self, wait: bool) -> list[str]:
        done: list[str] = []
        while self._pending:
            req_id, event = self._pending[0]
            if event is not None and not event.query():
                if done or not wait:
                    break
                with host_sync_point():  # nothing else to do: the oldest load, then report
                    event.synchronize()
            done.append(req_id)
            self._pending.popleft()
        return done

    def _copy_in(self, transfers: KVTransfers) -> bool:
        """Each request's load, then an event for it; True if pairs no load names are left
        (a tier that does not name its loads: the step waits for them, as before 2.18)."""
        start = 0
        for req_id, n in transfers.loads:
            self._copy_in_blocks(transfers.swap_in[start : start + n])
            start += n
            event = None
            if self.load_stream is not None:
                event = torch.cuda.Event()
                event.record(self.load_stream)
                self._load_events[req_id] = event
            self._pending.append((req_id, event))
        self._copy_in_blocks(transfers.swap_in[start:])
        return start < len(transfers.swap_in)

    # Each batch of blocks goes through a device staging buffer ``[blocks, layers, ...]``:
    # one gather (or scatter) kernel per layer on the device side, one copy per run of
    # consecutive tier blocks on the host side.
    def _copy_out(self, pairs: list[tuple[int, int]]) -> None:
        n = self.blocks_per_batch
        for i in range(0, len(pairs), n):
            gpu_ids, cpu_ids = zip(*pairs[i : i + n])
            src = self._index(gpu_ids)
            staged = torch.stack([c.index_select(self.block_dim, src).movedim(self.block_dim, 0) for c in self.gpu_caches], 1)
            for a, b, first in _runs(cpu_ids):
                self.cpu_cache[first : first + b - a].copy_(staged[a:b], non_blocking=True)

    def _copy_in_blocks(self, pairs: list[tuple[int, int]]) -> None:
        n = self.blocks_per_batch
        for i in range(0, len(pairs), n):
            cpu_ids, gpu_ids = zip(*pairs[i : i + n])
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
