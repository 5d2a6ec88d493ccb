"""Small builders shared by the paged KV-cache tests (block pool, prefix cache, manager)."""

from __future__ import annotations

from engine.kv_cache import BlockPool, KVCacheBlocks, KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def tokens(n: int, start: int = 0) -> list[int]:
    """n distinct token ids start, start+1, ...: prompts built from disjoint ranges share nothing."""
    return list(range(start, start + n))


def make_request(
    request_id: str = "r",
    prompt_token_ids: list[int] | None = None,
    *,
    max_tokens: int = 16,
    cache_salt: str | None = None,
) -> Request:
    prompt = tokens(2 * BLOCK_SIZE) if prompt_token_ids is None else list(prompt_token_ids)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens),
        max_tokens=max_tokens,
        cache_salt=cache_salt,
    )


def make_manager(
    num_blocks: int = 16, block_size: int = BLOCK_SIZE, enable_caching: bool = True
) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, enable_caching=enable_caching)


def make_pool(num_blocks: int = 8, enable_caching: bool = True) -> BlockPool:
    return BlockPool(num_blocks, enable_caching)


def prefill(manager: KVCacheManager, request: Request) -> tuple[KVCacheBlocks, int]:
    """Schedule a waiting request's whole prompt the way the scheduler does: look up the
    prefix cache, allocate the rest, then advance num_computed_tokens. Returns the
    prefix hit (blocks, num_hit_tokens)."""
    hit, num_hit_tokens = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, num_hit_tokens, hit)
    assert new is not None, f"prefill of {request.request_id} did not fit"
    if request.num_cached_tokens < 0:  # first admission, as the scheduler records it
        request.num_cached_tokens = num_hit_tokens
        manager.record_prefix_lookup(request.num_tokens, num_hit_tokens)
    request.num_computed_tokens = request.num_tokens
    return hit, num_hit_tokens


def decode_step(manager: KVCacheManager, request: Request, token_id: int) -> KVCacheBlocks:
    """Append one sampled token and schedule it (one new token to compute)."""
    request.append_output_token(token_id)
    new = manager.allocate_slots(request, 1)
    assert new is not None, f"decode of {request.request_id} did not fit"
    request.num_computed_tokens += 1
    return new


def free_block_ids(manager_or_pool: KVCacheManager | BlockPool) -> list[int]:
    """Ids of the free blocks in eviction order (the first is evicted first)."""
    pool = getattr(manager_or_pool, "block_pool", manager_or_pool)
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def cached_block_ids(manager_or_pool: KVCacheManager | BlockPool) -> set[int]:
    """Ids of the blocks reachable through the prefix-cache index."""
    pool = getattr(manager_or_pool, "block_pool", manager_or_pool)
    return {b.block_id for b in pool.cached_block_hash_to_block.values()}


def ref_counts(manager_or_pool: KVCacheManager | BlockPool) -> list[int]:
    pool = getattr(manager_or_pool, "block_pool", manager_or_pool)
    return [b.ref_cnt for b in pool.blocks]


def request_blocks(manager: KVCacheManager, request: Request):
    return manager.req_to_blocks[request.request_id]
