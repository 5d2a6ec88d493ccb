"""Per-request KV block allocation on top of the BlockPool, with prefix caching (vLLM's
KVCacheManager; docs/architecture.md#layers)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from engine.kv_cache.events import KVEventLog
from engine.kv_cache.hashing import extend_block_hashes
from engine.request import Request


@dataclass
class KVCacheBlocks:
    """What the scheduler sees of an allocation: blocks, never the pool's internals.
    `blocks` are the main group's; `window_blocks` the sliding-window group's (hybrid models
    only), one per block of the request like the main ones, the null block where a block
    fell out of the window."""

    blocks: list[KVCacheBlock] = field(default_factory=list)
    window_blocks: list[KVCacheBlock] = field(default_factory=list)

    def get_block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def get_window_block_ids(self) -> list[int]:
        return [b.block_id for b in self.window_blocks]

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


class _Group:
    """One KV cache group: the layers that share a block table, their pool, and each
    request's blocks in it. A window group (window > 0) frees a request's blocks once no
    future query can see them and puts its pool's null block in their place."""

    def __init__(self, num_blocks: int, enable_caching: bool, window: int, block_size: int = 16) -> None:
        self.pool = BlockPool(num_blocks, enable_caching, block_size)
        self.window = window
        self.null = self.pool.take_null_block() if window else None
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached: dict[str, int] = {}

    def first_needed(self, num_computed: int, block_size: int) -> int:
        """Index of the first block a query at position >= num_computed can still see (0 for
        full attention): the window of position p is (p - window, p]."""
        return max(0, num_computed - self.window + 1) // block_size if self.window else 0

    def window_hit(self, hashes: list[bytes], k_max: int, block_size: int) -> int:
        """Largest k <= k_max whose first k blocks' visible tail (from first_needed(k blocks)
        on) is all cached: a window group needs no block before that to resume at block k."""
        for k in range(k_max, 0, -1):
            start = self.first_needed(k * block_size, block_size)
            if all(self.pool.get_cached_block(h) is not None for h in hashes[start:k]):
                return k
        return 0

    def hit_blocks(self, hashes: list[bytes], k: int, block_size: int) -> list[KVCacheBlock]:
        start = self.first_needed(k * block_size, block_size)
        return [self.null] * start + [self.pool.get_cached_block(h) for h in hashes[start:k]]

    def release_unreachable(self, request_id: str, num_computed: int, block_size: int) -> None:
        """Free the request's blocks before the window of its next query (window groups)."""
        blocks = self.req_blocks.get(request_id)
        if not self.window or not blocks:
            return
        stop = min(self.first_needed(num_computed, block_size), len(blocks))
        gone = [b for b in blocks[:stop] if b is not self.null]
        if gone:
            blocks[:stop] = [self.null] * stop
            self.pool.free_blocks(gone)

    def num_reclaimable(self, request_id: str, num_computed: int, block_size: int) -> int:
        blocks = self.req_blocks.get(request_id, [])
        stop = min(self.first_needed(num_computed, block_size), len(blocks))
        return sum(1 for b in blocks[:stop] if b is not self.null) if self.window else 0


class KVCacheManager:
    """Blocks per request in one group (every layer), or, for a hybrid model (vLLM's hybrid
    allocator), in a main group of full-attention layers and a window group of
    sliding-window layers with its own pool, whose blocks per request stay bounded by
    window / block_size + 2 (plus a chunk's). `main_window` > 0 makes the main group itself a
    window group (a model whose every layer slides)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, *,
                 main_window: int = 0, window: int = 0, num_window_blocks: int = 0) -> None:
        if window and num_window_blocks < 2:
            raise ValueError(f"a window group needs at least 2 blocks, got {num_window_blocks}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups = [_Group(num_blocks, enable_caching, main_window, block_size)]
        if window:
            self.groups.append(_Group(num_window_blocks, enable_caching, window, block_size))
        main = self.groups[0]
        # The main group under the names the scheduler and tests have always used.
        self.block_pool = main.pool
        self.req_to_blocks = main.req_blocks
        self.num_cached_blocks = main.num_cached
        self.stats = PrefixCacheStats()

    @property
    def window_group(self) -> _Group | None:
        return self.groups[1] if len(self.groups) > 1 else None

    @property
    def num_blocks(self) -> int:
        """Blocks of the main group requests can hold (an all-window model reserves one)."""
        return self.block_pool.num_usable_blocks

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest prefix-cache hit for a request being scheduled from scratch: the longest
        prefix every group can resume from (a window group needs only its window's blocks).

        NOTE: the hit is capped at num_tokens - 1 so that at least the last token is
        recomputed: the model must run on something to produce the next token's logits.
        """
        if not self.enable_caching:
            return KVCacheBlocks(), 0
        if request.pooling_params is not None or (
                request.sampling_params.prompt_logprobs is not None and not request.output_token_ids):
            # Its prompt logprobs (or pooling: engine.pooling.pooler) need every prompt position's
            # hidden states: computed, not looked up (vLLM does the same). Its blocks are still
            # cached for others.
            return KVCacheBlocks(), 0
        extend_block_hashes(
            request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt,
            request.mm_features, request.lora_request and request.lora_request.lora_name,
        )
        bs = self.block_size
        hashes = request.block_hashes[: (request.num_tokens - 1) // bs]
        main = self.groups[0]
        if main.window:
            k = main.window_hit(hashes, len(hashes), bs)
        else:
            k = 0
            while k < len(hashes) and main.pool.get_cached_block(hashes[k]) is not None:
                k += 1
        window = self.window_group
        if window is not None:
            # Each group may shorten the hit; the main group's full prefix stays valid for
            # any shorter k, so one pass settles it.
            k = window.window_hit(hashes, k, bs)
        hit = KVCacheBlocks(main.hit_blocks(hashes, k, bs) if main.window else
                            [main.pool.get_cached_block(h) for h in hashes[:k]])
        if window is not None:
            hit.window_blocks = window.hit_blocks(hashes, k, bs)
        return hit, k * bs

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
        will load into fresh blocks. A window group first frees the blocks no query from
        here on can see, and gets the null block for new blocks that start out of sight.
        Returns the newly allocated blocks, or None (with no state changed) when a pool
        cannot satisfy the request.
        """
        rid, bs = request.request_id, self.block_size
        total_computed = (
            request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
        )
        num_required = -(-(total_computed + num_new_tokens) // bs)
        hits = new_computed_blocks or KVCacheBlocks()
        plans = []
        for group, computed in zip(self.groups, (hits.blocks, hits.window_blocks)):
            have = len(group.req_blocks.get(rid, [])) + len(computed)
            start = group.first_needed(total_computed, bs)
            num_null = max(0, min(start, num_required) - have)
            num_new = max(num_required - have, 0) - num_null
            # Touching a hit block with ref_cnt 0 takes it out of the free pool too.
            taken = num_new + sum(1 for b in computed if b.ref_cnt == 0 and b is not group.null)
            free = group.pool.get_num_free_blocks() + group.num_reclaimable(rid, total_computed, bs)
            if taken > free:
                return None
            plans.append((group, computed, num_null, num_new))

        out = KVCacheBlocks()
        for i, (group, computed, num_null, num_new) in enumerate(plans):
            group.release_unreachable(rid, total_computed, bs)
            group.pool.touch(computed)
            req_blocks = group.req_blocks.setdefault(rid, [])
            req_blocks.extend(computed)
            new_blocks = [group.null] * num_null + group.pool.get_new_blocks(num_new)
            req_blocks.extend(new_blocks)
            if i == 0:
                out.blocks = new_blocks
            else:
                out.window_blocks = new_blocks
        if self.enable_caching and not delay_cache_blocks:
            self.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return out

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks covering its first num_computed_tokens tokens,
        in every group (a window group's null placeholders are skipped)."""
        if not self.enable_caching:
            return
        extend_block_hashes(
            request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt,
            request.mm_features, request.lora_request and request.lora_request.lora_name,
        )
        rid = request.request_id
        for group in self.groups:
            blocks = group.req_blocks.get(rid, [])
            num_full = min(num_computed_tokens // self.block_size, len(blocks), len(request.block_hashes))
            start = group.num_cached.get(rid, 0)
            if num_full > start:
                group.pool.cache_full_blocks(blocks, request.block_hashes, start, num_full)
                group.num_cached[rid] = num_full

    def free(self, request: Request) -> None:
        """Release a request's blocks. Tail blocks go to the free queue first, so they are
        evicted before the shared prefix blocks that are more likely to be hit again."""
        self.free_by_id(request.request_id)

    def free_by_id(self, request_id: str) -> None:
        """`free` for a request the scheduler no longer tracks (e.g. after a delayed free)."""
        for group in self.groups:
            blocks = group.req_blocks.pop(request_id, [])
            group.num_cached.pop(request_id, None)
            group.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids in each group, the main group's first."""
        return tuple([b.block_id for b in g.req_blocks.get(request_id, [])] for g in self.groups)

    def get_window_block_ids(self, request_id: str) -> list[int] | None:
        """The window group's block ids of the request (None: no window group)."""
        window = self.window_group
        return None if window is None else [b.block_id for b in window.req_blocks.get(request_id, [])]

    def publish_events(self, log: KVEventLog) -> None:
        """Tell `log` of every prefix block the main group stores or evicts. The main group's
        blocks are what a router matches a prompt against; a hybrid model's window group
        only follows them (a hit there is a subset of the main group's)."""
        self.block_pool.events = log

    def cached_hashes(self) -> tuple[bytes, ...]:
        """The hashes of every block in the main group's prefix cache (a KV snapshot)."""
        return tuple(self.block_pool.cached_block_hash_to_block)

    def reset_prefix_cache(self) -> bool:
        if any(g.pool.get_num_free_blocks() != g.pool.num_usable_blocks for g in self.groups):
            return False
        for group in self.groups:
            group.pool.reset_prefix_cache()
        self.stats = PrefixCacheStats()
        return True
