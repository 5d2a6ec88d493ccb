"""The scheduler side's view of the host tier: which block hashes it holds, in LRU order,
bounded in blocks, and the KV events (medium "host") of what it stored and dropped.

The scheduler side decides alone what is stored, loaded and evicted, and tells every worker
rank in the step's metadata; the ranks hold the bytes (each its own heads) and follow. So a
lookup never waits on a worker, and every rank evicts the same blocks.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.kv_cache.events import HOST, BlockRemoved, BlockStored, KVEvent


class HostIndex:
    def __init__(self, capacity_blocks: int, block_size: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._held: OrderedDict[bytes, None] = OrderedDict()
        self._events: list[KVEvent] = []
        # Blocks added since the last event, consecutive in one prompt, and the parent of the
        # first: told as one BlockStored.
        self._run: list[bytes] = []
        self._run_parent: bytes | None = None
        self.evictions = 0  # blocks dropped to make room (cumulative)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._held

    def __len__(self) -> int:
        return len(self._held)

    def hashes(self) -> tuple[bytes, ...]:
        return tuple(self._held)

    def prefix_hits(self, block_hashes: list[bytes], start: int, stop: int) -> int:
        """How many of block_hashes[start:stop], consecutively from `start`, are held."""
        n = 0
        for h in block_hashes[start:stop]:
            if h not in self._held:
                break
            n += 1
        return n

    def touch(self, block_hashes) -> None:
        """Mark blocks as just used (a load): the last to be evicted."""
        for h in block_hashes:
            if h in self._held:
                self._held.move_to_end(h)

    def add(self, block_hash: bytes, parent: bytes | None) -> list[bytes]:
        """Hold one more block (`parent`: the hash of the block before it in its prompt, None
        for a first block); returns the blocks evicted to make room, oldest first."""
        evicted = []
        while len(self._held) >= self.capacity_blocks:
            evicted.append(self._held.popitem(last=False)[0])
        if evicted:
            # NOTE: the run told so far goes out first, so that a block stored and evicted
            # within one step is told in that order.
            self._flush_run()
            self.evictions += len(evicted)
            self._events.append(BlockRemoved(tuple(evicted), HOST))
        self._held[block_hash] = None
        if self._run and self._run[-1] == parent:
            self._run.append(block_hash)
        else:
            self._flush_run()
            self._run, self._run_parent = [block_hash], parent
        return evicted

    def _flush_run(self) -> None:
        """One BlockStored per run of consecutive blocks, as the device pool tells its runs."""
        if self._run:
            self._events.append(BlockStored(tuple(self._run), self._run_parent,
                                            len(self._run) * self.block_size, HOST))
        self._run, self._run_parent = [], None

    def remove(self, block_hashes) -> list[bytes]:
        """Forget blocks (refused on load); returns those that were held."""
        gone = [h for h in block_hashes if self._held.pop(h, 0) is None]
        if gone:
            self._flush_run()
            self._events.append(BlockRemoved(tuple(gone), HOST))
        return gone

    def take_events(self) -> list[KVEvent]:
        self._flush_run()
        events, self._events = self._events, []
        return events
