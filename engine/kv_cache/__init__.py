"""Paged KV cache bookkeeping: block pool, prefix-cache hashing, per-request manager."""

from engine.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from engine.kv_cache.hashing import NONE_HASH, hash_block_tokens
from engine.kv_cache.manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats

__all__ = [
    "NONE_HASH",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheManager",
    "PrefixCacheStats",
    "hash_block_tokens",
]
