"""The shared KV tier's directory: which prefix blocks the cluster holds, where their bytes
are, in LRU order, bounded in bytes, each on a lease.

Pure Python with an injectable clock; `kvstore.store_actor` holds one per app. An entry holds
a handle to the block's bytes (a Ray ObjectRef, wrapped in a list so the actor never resolves
it), never the bytes. Dropping an entry drops the directory's reference: once no reader holds
one either, Ray frees the object.

Every block added or removed bumps `version`, so a replica's mirror of the key set
(kvstore.shared_mirror) asks "anything new since version v?" and gets nothing back when
nothing changed, the changes when the recent-change log still covers v, else the whole set.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

# Changes remembered for mirrors that ask for a delta (about 2 MB); one further behind gets
# the whole key set.
_LOG_LEN = 50_000


@dataclass
class SharedBlock:
    location: list  # [ObjectRef]: the list keeps Ray from resolving the reference in transit
    nbytes: int
    crc32: int
    shape: tuple[int, ...]
    dtype: str
    owner: str  # whose process put (and owns) the object: a replica, or the store (ADOPTED)
    deadline: float


class SharedDirectory:
    def __init__(self, capacity_bytes: int, lease_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic, log_len: int = _LOG_LEN) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.capacity_bytes = capacity_bytes
        self.lease_s = lease_s
        self._clock = clock
        self._blocks: OrderedDict[bytes, SharedBlock] = OrderedDict()  # least recently used first
        self.bytes_held = 0
        self.version = 0
        # (version, hash, added?): the change that made `version`, oldest first.
        self._log: deque[tuple[int, bytes, bool]] = deque(maxlen=log_len)
        self.counts = {"stored": 0, "duplicates": 0, "too_big": 0, "evicted": 0, "expired": 0,
                       "dropped": 0, "owner_dropped": 0, "hits": 0, "misses": 0}

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, block_hash: bytes, block: SharedBlock) -> list[bytes]:
        """Hold one block (a block already held keeps its first copy: equal hashes are equal KV);
        returns the blocks evicted to make room, least recently used first."""
        if block_hash in self._blocks:
            self.counts["duplicates"] += 1
            return []
        if block.nbytes > self.capacity_bytes:
            self.counts["too_big"] += 1
            return []
        evicted = []
        while self.bytes_held + block.nbytes > self.capacity_bytes:
            gone, old = self._blocks.popitem(last=False)
            self.bytes_held -= old.nbytes
            evicted.append(gone)
            self._changed(gone, added=False)
        self.counts["evicted"] += len(evicted)
        block.deadline = self._clock() + self.lease_s
        self._blocks[block_hash] = block
        self.bytes_held += block.nbytes
        self.counts["stored"] += 1
        self._changed(block_hash, added=True)
        return evicted

    def _changed(self, block_hash: bytes, added: bool) -> None:
        self.version += 1
        self._log.append((self.version, block_hash, added))

    def get(self, block_hashes: list[bytes]) -> list[SharedBlock | None]:
        """The entries of `block_hashes` (None where not held); a hit is used again, so it goes
        last in the LRU order and its lease starts over."""
        now = self._clock()
        found = []
        for h in block_hashes:
            block = self._blocks.get(h)
            if block is not None:
                self._blocks.move_to_end(h)
                block.deadline = now + self.lease_s
            found.append(block)
        hits = sum(b is not None for b in found)
        self.counts["hits"] += hits
        self.counts["misses"] += len(found) - hits
        return found

    def _remove(self, block_hashes, count: str) -> list[bytes]:
        gone = []
        for h in block_hashes:
            block = self._blocks.pop(h, None)
            if block is not None:
                self.bytes_held -= block.nbytes
                gone.append(h)
                self._changed(h, added=False)
        self.counts[count] += len(gone)
        return gone

    def drop(self, block_hashes) -> list[bytes]:
        """Forget blocks a reader refused (corrupt, or their bytes are gone)."""
        return self._remove(block_hashes, "dropped")

    def drop_owner(self, owner: str) -> list[bytes]:
        """Forget every block a replica put: its process owns their objects, which die with it."""
        return self._remove([h for h, b in self._blocks.items() if b.owner == owner], "owner_dropped")

    def owned_by(self, owner: str) -> list[tuple[bytes, SharedBlock]]:
        return [(h, b) for h, b in self._blocks.items() if b.owner == owner]

    def relocate(self, block_hash: bytes, location: list, owner: str, was_owner: str) -> bool:
        """Point a block at a copy of its bytes that `owner` holds, if `was_owner` still has
        it (it may have been evicted or replaced meanwhile). The key set does not change."""
        block = self._blocks.get(block_hash)
        if block is None or block.owner != was_owner:
            return False
        block.location, block.owner = location, owner
        return True

    def sweep(self, advance_s: float = 0.0) -> list[bytes]:
        """Drop every block whose lease has passed (as of `advance_s` seconds from now)."""
        now = self._clock() + advance_s
        return self._remove([h for h, b in self._blocks.items() if b.deadline <= now], "expired")

    def keys(self) -> list[bytes]:
        return list(self._blocks)

    def changes_since(self, version: int) -> dict | None:
        """What changed after `version`: None if nothing; {"version", "added", "removed"} when
        the log still holds every change since; else {"version", "keys"}, the whole set."""
        if version == self.version:
            return None
        log = self._log
        if 0 <= version < self.version and log and log[0][0] <= version + 1:
            changes: dict[bytes, bool] = {}  # the last change of each hash decides
            for v, h, added in reversed(log):
                if v <= version:
                    break
                changes.setdefault(h, added)
            return {"version": self.version, "added": [h for h, a in changes.items() if a],
                    "removed": [h for h, a in changes.items() if not a]}
        return {"version": self.version, "keys": list(self._blocks)}

    def stats(self) -> dict:
        return {"blocks": len(self._blocks), "bytes": self.bytes_held, "capacity_bytes": self.capacity_bytes,
                "version": self.version, **self.counts}
