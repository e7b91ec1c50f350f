"""KVCacheManager: which blocks each request holds, prefix-cache lookups, and stats."""

from __future__ import annotations

from dataclasses import dataclass

from pagelm.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagelm.kv_offload import KVOffloadTier
from pagelm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache

    def record(self, num_queried: int, num_hit: int) -> None:
        self.queries += num_queried
        self.hits += num_hit

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Maps requests to blocks. The scheduler asks ``get_computed_blocks`` at admission and
    ``allocate_slots`` every step; ``None`` from ``allocate_slots`` means "no room", and the
    scheduler preempts. After every request has finished or been aborted, all blocks are free.

    With a second tier (``offload``, see ``pagelm.kv_offload``) a prefix lookup that misses
    on the GPU goes on in the tier, blocks the pool evicts are spilled to it, and a preempted
    request may be swapped out to it (``swap_out``) and loaded back at its next admission.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool, offload: KVOffloadTier | None = None
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's blocks are already registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self.offload = offload
        # This step's loads from the tier, in the order their swap-ins were queued.
        self._loads: list[tuple[str, int]] = []
        if offload is not None and enable_caching:
            self.pool.on_evict = offload.spill

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in whole blocks. Stops at the first miss.
        At least the last token is always left to compute (its logits are needed). The
        scheduler records the lookup in ``prefix_cache_stats`` once the request is admitted.

        With a tier the count goes on past the GPU hits with blocks the tier holds, which
        ``allocate_slots`` loads; a swapped-out request's computed tokens all come from the
        tier (they are its own: no lookup)."""
        if self.offload is not None:
            num_swapped = self.offload.num_swapped_tokens(request.request_id)
            if num_swapped:
                return [], num_swapped
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        # A full hit still recomputes the last token: look up at most num_tokens - 1 tokens.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_tier_hits = 0
        if self.offload is not None and len(hits) < max_blocks:
            num_tier_hits = self.offload.count_hits(request.block_hashes[len(hits) : max_blocks])
        return hits, (len(hits) + num_tier_hits) * self.block_size

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` (plus speculative lookahead slots) after the
        request's computed tokens, taking ``new_computed_blocks`` (prefix hits) first::

            | computed | new_computed (hits) | loaded (tier) | new tokens | lookahead |
                                             ^ slots allocated here

        ``num_new_computed_tokens`` (``get_computed_blocks``' count) may exceed the GPU hits:
        the rest is in the tier and is copied into the first new blocks before the step.
        Returns the newly allocated blocks, or None (nothing changed) if the pool is short.
        """
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_hit = len(new_computed_blocks) * self.block_size
        num_loaded = 0 if num_new_computed_tokens is None else num_new_computed_tokens - num_hit
        num_computed = request.num_computed_tokens + num_hit + num_loaded
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(new_computed_blocks))
        # Hits that sit in the free queue stop being allocatable once we take them.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None

        self.pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        if num_loaded:
            num_load_blocks = cdiv(num_loaded, self.block_size)
            self.offload.load(request, len(req_blocks), [b.block_id for b in new_blocks[:num_load_blocks]])
            self._loads.append((request.request_id, num_load_blocks))
        req_blocks.extend(new_blocks)

        if self.enable_caching and not request.skip_prefix_cache:
            # Blocks full once this step's tokens are computed join the cache now: a request
            # admitted later in the same step may hit them, since every layer writes its KV
            # before it attends.
            num_full = min((num_computed + num_new_tokens) // self.block_size, len(request.block_hashes))
            done = self.num_cached_blocks.get(request.request_id, 0)
            if num_full > done:
                self.pool.cache_full_blocks(req_blocks[done:num_full], request.block_hashes[done:num_full])
                self.num_cached_blocks[request.request_id] = num_full
        return new_blocks

    def uncache_unwritten(self, request: Request) -> list[KVCacheBlock]:
        """Take back the prefix-cache entries of the request's blocks past its computed tokens::

            | computed (written, or written by a launched step) | booked this step |
                                                                ^ num_computed_tokens

        ``allocate_slots`` registers blocks that this step's tokens fill before the forward
        pass; when the request gives way in that same step nobody writes them, and a later
        hit would read garbage. Returns the blocks taken back that other requests may have
        hit in this step (the scheduler makes those give way too)."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        first = request.num_computed_tokens // self.block_size
        done = self.num_cached_blocks.get(request.request_id, 0)
        if done <= first:
            return []
        self.num_cached_blocks[request.request_id] = first
        return self.pool.uncache_blocks(blocks[first:done])

    def swap_out(self, request: Request, force: bool) -> bool:
        """Preempt by swapping: the tier keeps the KV of the request's computed tokens and
        its GPU blocks are freed; ``get_computed_blocks`` then counts those tokens as its hits.
        False (nothing changed): no tier, no room, or (unless ``force``) recomputing is cheaper."""
        num_tokens = request.num_computed_tokens
        if self.offload is None or num_tokens == 0:
            return False
        blocks = self.req_to_blocks.get(request.request_id, [])[: cdiv(num_tokens, self.block_size)]
        if not self.offload.swap_out(request.request_id, blocks, num_tokens, force):
            return False
        self._free_gpu(request)
        return True

    def take_transfers(self):
        """This step's copies between the tiers (``SchedulerOutput.kv_transfers``), with the
        request each load is for (the runner reports each one when it lands)."""
        if self.offload is None:
            return None
        transfers = self.offload.take_transfers()
        if self._loads:
            transfers.loads, self._loads = self._loads, []
        return transfers

    def reset_after_failure(self) -> None:
        """After a failed step, once every request is freed: forget the prefix cache (it may
        name blocks whose KV was never written), the tier's queued copies, and loads booked
        by a ``schedule()`` that raised before ``take_transfers`` (their requests are gone;
        copying them later would write into blocks someone else may hold by then)."""
        self._loads.clear()
        self.pool.reset_prefix_cache()
        if self.offload is not None:
            self.offload.reset()

    def loads_landed(self, request_ids: list[str]) -> None:
        """The runner reports these loads from the tier landed: the tier may reuse their sources."""
        if self.offload is not None:
            self.offload.loads_landed(request_ids)

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first so the shared prefix is evicted last (and
        its swapped-out blocks in the tier, if any)."""
        self._free_gpu(request)
        if self.offload is not None:
            self.offload.free(request.request_id)

    def _free_gpu(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))
