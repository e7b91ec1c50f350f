"""The CPU tier's bookkeeping, in the scheduler's process: a second ``BlockPool`` over the
host blocks (free queue in LRU order, reference counts, hash -> block map), the requests
swapped out to it, and the copies its decisions need.

A prefix block lives on the GPU, in the tier or in both; each tier evicts its own least
recently used free block first. A lookup walks the GPU pool's map, then this one
(``KVCacheManager.get_computed_blocks``): together they answer "where is the KV of this
hash". Who holds a tier block::

    a swapped-out request       (its blocks, until it is loaded back, finishes or aborts)
    a load                      (its copies' sources, until the runner reports it landed:
                                 a spill must not overwrite a block a queued load reads)
    nobody: free, maybe cached  (a spilled or once-swapped prefix block, evicted LRU)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pagelm.kv_cache import BlockPool, KVCacheBlock
from pagelm.kv_cache.block_hash import BlockHash
from pagelm.kv_offload import KVOffloadStats, KVOffloadTier, KVTransfers
from pagelm.request import Request

from pagelm.plugins.kv_offload.cost import SwapCost


class CPUTier(KVOffloadTier):
    def __init__(self, num_blocks: int, block_size: int, block_bytes: int, cost: SwapCost) -> None:
        self.block_size = block_size
        self.cost = cost
        self.pool = BlockPool(num_blocks)
        # request id -> (its tier blocks in order, how many tokens they hold)
        self.swapped: dict[str, tuple[list[KVCacheBlock], int]] = {}
        self._transfers = KVTransfers()
        # This step: GPU block id -> the tier block it is loaded from (its KV, until the copy
        # runs, is still only there); GPU blocks evicted from the prefix cache, to spill once
        # the step is decided. And the tier blocks each queued load reads, until it lands.
        self._loading: dict[int, KVCacheBlock] = {}
        self._spills: list[tuple[int, BlockHash]] = []
        self._load_sources: dict[str, list[KVCacheBlock]] = {}
        self._stats = KVOffloadStats(num_blocks=num_blocks, block_bytes=block_bytes)

    # ---- lookups -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def count_hits(self, block_hashes: Sequence[BlockHash]) -> int:
        n = 0
        for block_hash in block_hashes:
            if block_hash not in self.pool.cached_blocks:
                break
            n += 1
        return n

    def num_swapped_tokens(self, request_id: str) -> int:
        entry = self.swapped.get(request_id)
        return 0 if entry is None else entry[1]

    # ---- decisions -----------------------------------------------------------------------
    def swap_out(self, request_id: str, blocks: Sequence[KVCacheBlock], num_tokens: int, force: bool) -> bool:
        """Tier blocks that already hold a GPU block's KV (the same prefix hash, or the block
        it is being loaded from this step) are shared instead of copied."""
        assert request_id not in self.swapped, f"{request_id} swapped out twice"
        held = [self._holder(b) for b in blocks]
        to_copy = [b for b, h in zip(blocks, held) if h is None]
        if not force:
            recompute = num_tokens - self.block_size * _leading_cached(blocks)
            if not self.cost.swap_is_cheaper(len(to_copy), recompute):
                return False
        reused = {h.block_id: h for h in held if h is not None}
        if len(to_copy) > self.pool.num_free_blocks - sum(1 for h in reused.values() if h.ref_cnt == 0):
            return False
        self.pool.touch(reused.values())
        new = iter(self.pool.get_new_blocks(len(to_copy)))
        tier_blocks = []
        for block, holder in zip(blocks, held):
            if holder is None:
                holder = next(new)
                self._transfers.swap_out.append((block.block_id, holder.block_id))
                if block.block_hash is not None:  # a prefix block: hit-able from the tier too
                    self.pool.cache_full_blocks([holder], [block.block_hash])
            tier_blocks.append(holder)
        self.swapped[request_id] = (tier_blocks, num_tokens)
        self._stats.num_swap_preemptions += 1
        self._stats.blocks_swapped_out += len(to_copy)
        return True

    def _holder(self, block: KVCacheBlock) -> KVCacheBlock | None:
        """The tier block that already holds ``block``'s KV, if any."""
        holder = self._loading.get(block.block_id)
        if holder is None and block.block_hash is not None:
            holder = self.pool.get_cached_block(block.block_hash)
        return holder

    def load(self, request: Request, start_block: int, block_ids: Sequence[int]) -> None:
        entry = self.swapped.pop(request.request_id, None)
        if entry is not None:
            sources = entry[0]
            assert start_block == 0 and len(sources) == len(block_ids), "a swapped request loads all its blocks"
            # the request's references, kept by the load until it lands
        else:
            hashes = request.block_hashes[start_block : start_block + len(block_ids)]
            sources = [self.pool.cached_blocks[h] for h in hashes]
            self.pool.touch(sources)
            self._stats.hit_blocks += len(sources)
        self._load_sources.setdefault(request.request_id, []).extend(sources)
        for src, dst in zip(sources, block_ids):
            self._transfers.swap_in.append((src.block_id, dst))
            self._loading[dst] = src
        self._stats.blocks_swapped_in += len(block_ids)

    def spill(self, block_id: int, block_hash: BlockHash) -> None:
        # Decided in take_transfers: until the step is decided a tier block may still be
        # claimed by a load, which a spill must not evict. A block loaded this step and evicted
        # already has no KV of its own yet: nothing to spill. (Whether it is loading is asked
        # now: the same GPU block may become a load's target later in the step, and the
        # step's spills are copied out before its loads are copied in.)
        if block_id not in self._loading:
            self._spills.append((block_id, block_hash))

    def free(self, request_id: str) -> None:
        entry = self.swapped.pop(request_id, None)
        if entry is not None:
            self.pool.free_blocks(reversed(entry[0]))

    def take_transfers(self) -> KVTransfers | None:
        """Spills, once the step's loads have claimed their sources."""
        for block_id, block_hash in self._spills:
            self._spill_now(block_id, block_hash)
        out = self._transfers if self._transfers else None
        self._transfers = KVTransfers()
        self._spills.clear()
        self._loading.clear()
        return out

    def loads_landed(self, request_ids) -> None:
        """Let go of these loads' sources: a later spill may now overwrite them (every rank's
        swap-outs wait for its own copy of a load the scheduler names in ``waits``)."""
        for req_id in request_ids:
            self.pool.free_blocks(self._load_sources.pop(req_id, ()))

    def _spill_now(self, block_id: int, block_hash: BlockHash) -> None:
        cached = self.pool.get_cached_block(block_hash)
        if cached is not None:  # already here: only its LRU position moves
            if cached.ref_cnt == 0:
                self.pool.free_queue.remove(cached)
                self.pool.free_queue.append(cached)
            return
        if self.pool.num_free_blocks == 0:  # every tier block is held: dropped, as without a tier
            return
        block = self.pool.get_new_blocks(1)[0]
        self.pool.cache_full_blocks([block], [block_hash])
        self.pool.free_blocks([block])  # nobody holds it: cached, evicted LRU
        self._transfers.swap_out.append((block_id, block.block_id))
        self._stats.blocks_swapped_out += 1

    def reset(self) -> None:
        self._transfers, self._spills, self._loading = KVTransfers(), [], {}
        for sources in self._load_sources.values():
            self.pool.free_blocks(sources)
        self._load_sources = {}
        self.pool.reset_prefix_cache()

    def stats(self) -> KVOffloadStats:
        self._stats.num_free_blocks = self.pool.num_free_blocks
        self._stats.num_swapped_requests = len(self.swapped)
        return replace(self._stats)


def _leading_cached(blocks: Sequence[KVCacheBlock]) -> int:
    """Blocks, from the first, in the prefix cache: recomputing finds them again."""
    n = 0
    for block in blocks:
        if block.block_hash is None:
            break
        n += 1
    return n
