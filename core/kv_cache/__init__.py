"""Paged KV cache management: block pool, prefix cache, per-request block lists."""

from pagelm.kv_cache.block_hash import BlockHash, hash_block_tokens, make_block_hasher
from pagelm.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagelm.kv_cache.manager import KVCacheManager, PrefixCacheStats, cdiv

__all__ = [
    "BlockHash",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "cdiv",
    "hash_block_tokens",
    "make_block_hasher",
]
