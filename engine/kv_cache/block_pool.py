"""Physical KV blocks, their ref counts, the LRU free queue and the prefix-cache index."""

from __future__ import annotations

from collections.abc import Iterable

from engine.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set once the block is full and registered in the prefix cache; cleared on eviction.
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order (head is evicted first).

    Removal from the middle is O(1): a cached block that gets a prefix hit is taken out of the
    queue without scanning it.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out = []
        cur = self._head.next_free
        while cur is not None and cur is not self._tail:
            out.append(cur)
            cur = cur.next_free
        return out


class BlockPool:
    """Owns every KV block. Blocks with ref_cnt 0 sit in the free queue; a freed block keeps
    its hash (lazy eviction) so it can still be hit until it is handed out again."""

    def __init__(self, num_blocks: int, enable_caching: bool, block_size: int = 16) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size  # tokens per block, for the events' token counts
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.null_block: KVCacheBlock | None = None
        # Where stored / removed prefix blocks are told (engine.kv_cache.events); None: nobody
        # listens, and the pool records nothing.
        self.events: KVEventLog | None = None

    def take_null_block(self) -> KVCacheBlock:
        """Reserve block 0 as the placeholder a sliding-window group puts where a request's
        blocks fell out of every window: never handed out, freed or cached (the kernels never
        read it: engine.kv_cache.manager)."""
        if self.null_block is None:
            block = self.blocks[0]
            self.free_block_queue.remove(block)
            block.ref_cnt = 1
            self.null_block = block
        return self.null_block

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - (self.null_block is not None)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(
        self, blocks: list[KVCacheBlock], block_hashes: list[bytes], start: int, end: int
    ) -> None:
        """Register blocks[start:end] (all full) under block_hashes[start:end]."""
        run_start = None  # first index of the current run of newly cached blocks (events)
        for i in range(start, end):
            block = blocks[i]
            new = False
            if block.block_hash is None and block is not self.null_block:  # else a prefix hit
                block.block_hash = block_hashes[i]
                # NOTE: if another request already cached identical content, keep the first
                # block as the canonical one; this block stays private to its request.
                new = self.cached_block_hash_to_block.setdefault(block_hashes[i], block) is block
            if self.events is None:
                continue
            if new and run_start is None:
                run_start = i
            elif not new and run_start is not None:
                self._stored(block_hashes, run_start, i)
                run_start = None
        if run_start is not None:
            self._stored(block_hashes, run_start, end)

    def _stored(self, block_hashes: list[bytes], start: int, end: int) -> None:
        """One BlockStored event per run of consecutive newly cached blocks."""
        parent = block_hashes[start - 1] if start > 0 else None
        self.events.record(BlockStored(tuple(block_hashes[start:end]), parent, (end - start) * self.block_size))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} blocks, only {self.free_block_queue.num_free_blocks} free"
            )
        out = []
        removed: list[bytes] = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict_cached_block(block, removed)
            block.ref_cnt = 1
            out.append(block)
        if removed and self.events is not None:
            self.events.record(BlockRemoved(tuple(removed)))
        return out

    def _evict_cached_block(self, block: KVCacheBlock, removed: list[bytes]) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
            removed.append(block.block_hash)
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching 0 join the free queue tail in the given order."""
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"{block} freed more times than it was referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if not self.enable_caching:
                    block.block_hash = None
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only possible while no block is in use."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.events is not None:
            self.events.record(AllBlocksCleared())
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks
