"""The pool of KV cache blocks: free queue in LRU order, ref counts, hash -> block map."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pagelm.kv_cache.block_hash import BlockHash


class KVCacheBlock:
    """One block of ``block_size`` token slots in every layer's cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is full and registered in the prefix cache.
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves.

    The head is evicted first (least recently freed). A cached block that gets a prefix hit
    while free is taken out of the middle in O(1); no operation allocates::

        head <-> b7 <-> b2 <-> b9 <-> tail
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block not in free queue"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """Owns every block. A block is in exactly one of: the free queue (ref_cnt 0, maybe still
    cached: lazy eviction), or in use by one or more requests (ref_cnt > 0)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        # Told of each prefix-cache block evicted for reuse (a KV tier spills it; None: dropped).
        self.on_evict: Callable[[int, BlockHash], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if self.on_evict is not None and self.cached_blocks.get(block.block_hash) is block:
                self.on_evict(block.block_id, block.block_hash)
            self._evict(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching zero join the free queue in the given order
        (callers pass a request's blocks tail first, so its prefix is evicted last)."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of {block}"
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash]) -> None:
        """Register newly filled blocks under their hashes. If an equal block is already cached
        (two requests computed the same prefix at once) the first one stays the cache entry."""
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is not None:
                continue
            block.block_hash = block_hash
            self.cached_blocks.setdefault(block_hash, block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (after a failed step, whose KV writes may not have
        happened). Only when no request holds a block: a held block's hash is its owner's."""
        assert self.num_free_blocks == self.num_blocks, "reset_prefix_cache with blocks in use"
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()

    def uncache_blocks(self, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """Take blocks out of the prefix cache before their KV exists (their writer gave way
        in the step that registered them). Returns those that were the cache's entry for
        their hash: another request may have taken a hit on them."""
        entries = [b for b in blocks if b.block_hash is not None and self.cached_blocks.get(b.block_hash) is b]
        for block in blocks:
            self._evict(block)
        return entries
