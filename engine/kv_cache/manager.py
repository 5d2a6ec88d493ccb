"""Per-request KV block allocation on top of the BlockPool, with prefix caching (vLLM's
KVCacheManager; docs/architecture.md#layers)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from engine.kv_cache.hashing import extend_block_hashes
from engine.request import Request


@dataclass
class KVCacheBlocks:
    """What the scheduler sees of an allocation: blocks, never the pool's internals."""

    blocks: list[KVCacheBlock] = field(default_factory=list)

    def get_block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def __len__(self) -> int:
        return len(self.blocks)


@dataclass
class PrefixCacheStats:
    requests: int = 0
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already registered in the cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest prefix-cache hit for a request being scheduled from scratch.

        NOTE: the hit is capped at num_tokens - 1 so that at least the last token is
        recomputed: the model must run on something to produce the next token's logits.
        """
        if not self.enable_caching:
            return KVCacheBlocks(), 0
        if request.sampling_params.prompt_logprobs is not None and not request.output_token_ids:
            # Its prompt logprobs need every prompt position's logits: computed, not looked up
            # (vLLM does the same). Its blocks are still cached for others.
            return KVCacheBlocks(), 0
        extend_block_hashes(
            request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt,
            request.mm_features,
        )
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return KVCacheBlocks(hit), len(hit) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup. The scheduler calls this once per request,
        on admission, so a request retried over several steps is not counted again."""
        if self.enable_caching:
            self.stats.requests += 1
            self.stats.queries += num_tokens
            self.stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Make room for `num_new_tokens` more tokens of `request`.

        `new_computed_blocks` / `num_new_computed_tokens` are a prefix hit from
        get_computed_blocks; `num_external_computed_tokens` are tokens whose KV a connector
        will load into fresh blocks. Returns the newly allocated blocks, or None (with no
        state changed) when the pool cannot satisfy the request.
        """
        computed = new_computed_blocks.blocks if new_computed_blocks else []
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        total_computed = (
            request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
        )
        num_required = -(-(total_computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(num_required - len(req_blocks) - len(computed), 0)
        # Touching a hit block with ref_cnt 0 takes it out of the free pool too.
        num_evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.block_pool.get_num_free_blocks():
            return None

        self.block_pool.touch(computed)
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        req_blocks.extend(computed)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if self.enable_caching and not delay_cache_blocks:
            self.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return KVCacheBlocks(new_blocks)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks covering its first num_computed_tokens tokens."""
        if not self.enable_caching:
            return
        extend_block_hashes(
            request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt,
            request.mm_features,
        )
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_full = min(num_computed_tokens // self.block_size, len(blocks), len(request.block_hashes))
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full > start:
            self.block_pool.cache_full_blocks(blocks, request.block_hashes, start, num_full)
            self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release a request's blocks. Tail blocks go to the free queue first, so they are
        evicted before the shared prefix blocks that are more likely to be hit again."""
        self.free_by_id(request.request_id)

    def free_by_id(self, request_id: str) -> None:
        """`free` for a request the scheduler no longer tracks (e.g. after a delayed free)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        ok = self.block_pool.reset_prefix_cache()
        if ok:
            self.stats = PrefixCacheStats()
        return ok
