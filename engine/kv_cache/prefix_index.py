"""Who holds which prefix blocks: the index a router keeps, fed by KV events
(engine.kv_cache.events) or rebuilt from snapshots (docs/kv_cache.md#kv-aware-routing).

Sources are whatever a router chooses between: data-parallel ranks, replicas. Keys are the
first KEY_BYTES bytes of a block's chained SHA-256 hash: 8 bytes keep a collision out of
reach for any pool size here, and a wrong match would only send a request where its prefix
is not (it is then computed: routing never changes tokens).

Memory is bounded per source (`max_blocks`): past it the oldest stored entries go first, as a
pool's LRU would evict them.

A router may also `predict` what a source will hold: the blocks of a prompt it just sent
there, which the source tells of only after computing them (and a replica's report comes a
period later). A prediction counts as a device block until it expires; the source's own
events and snapshots never remove it, so a next turn sent at once still finds its history.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.kv_cache.events import (
    MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVSnapshot,
)

KEY_BYTES = 8


def key(block_hash: bytes) -> bytes:
    return block_hash[:KEY_BYTES]


def pack(hashes) -> bytes:
    """Block hashes as one compact bytes value (KEY_BYTES each), for routing stats."""
    return b"".join(h[:KEY_BYTES] for h in hashes)


def unpack(packed: bytes) -> list[bytes]:
    return [packed[i:i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)]


@dataclass(frozen=True)
class Match:
    """A source's longest cached prefix of a prompt: blocks per medium within it."""

    blocks: int = 0
    device: int = 0
    host: int = 0
    shared: int = 0


class _Source:
    __slots__ = ("held", "seq", "predicted")

    def __init__(self) -> None:
        # medium -> keys, insertion ordered (oldest first) so the bound drops the oldest.
        self.held: dict[str, dict[bytes, None]] = {m: {} for m in MEDIA}
        self.seq = 0
        self.predicted: dict[bytes, float] = {}  # key -> monotonic time it expires


class PrefixIndex:
    def __init__(self, max_blocks: int = 1 << 17) -> None:
        self.max_blocks = max_blocks
        self._sources: dict[object, _Source] = {}

    def sources(self) -> list:
        return list(self._sources)

    def seq(self, source) -> int | None:
        """The last event batch applied for `source` (None: never heard of it)."""
        s = self._sources.get(source)
        return None if s is None else s.seq

    def drop(self, source) -> None:
        self._sources.pop(source, None)

    def replace(self, source, snapshot: KVSnapshot) -> None:
        s = _Source()
        old = self._sources.get(source)
        if old is not None:
            s.predicted = old.predicted
        for medium, hashes in snapshot.held.items():
            s.held[medium] = dict.fromkeys(key(h) for h in hashes)
            self._trim(s.held[medium])
        s.seq = snapshot.seq
        self._sources[source] = s

    def apply(self, source, batch: KVEventBatch) -> bool:
        """Apply one batch; False (nothing applied) when batches before it were missed: the
        caller then replaces the source from a snapshot."""
        s = self._sources.setdefault(source, _Source())
        if batch.seq <= s.seq:
            return True  # already applied
        if batch.seq != s.seq + 1:
            return False
        for event in batch.events:
            held = s.held[event.medium]
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    k = key(h)
                    held.pop(k, None)  # re-stored: now the newest
                    held[k] = None
                self._trim(held)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    held.pop(key(h), None)
            elif isinstance(event, AllBlocksCleared):
                held.clear()
        s.seq = batch.seq
        return True

    def update(self, source, update: list[KVEventBatch] | KVSnapshot) -> bool:
        """Apply what KVEventLog.since answered; False when a gap needs a snapshot."""
        if isinstance(update, KVSnapshot):
            self.replace(source, update)
            return True
        return all(self.apply(source, batch) for batch in update)

    def predict(self, source, block_hashes: list[bytes], ttl_s: float) -> None:
        """`source` will hold these blocks (a request was just sent there), for `ttl_s`."""
        s = self._sources.setdefault(source, _Source())
        now = time.monotonic()
        if len(s.predicted) > self.max_blocks:
            s.predicted = {k: t for k, t in s.predicted.items() if t > now}
        for h in block_hashes:
            s.predicted.pop(key(h), None)
            s.predicted[key(h)] = now + ttl_s
        while len(s.predicted) > self.max_blocks:
            del s.predicted[next(iter(s.predicted))]

    def _trim(self, held: dict[bytes, None]) -> None:
        while len(held) > self.max_blocks:
            del held[next(iter(held))]

    def counts(self, source) -> dict[str, int]:
        s = self._sources.get(source)
        return {m: (len(s.held[m]) if s else 0) for m in MEDIA}

    def held(self, source, medium: str) -> list[bytes]:
        s = self._sources.get(source)
        return list(s.held[medium]) if s else []

    def match(self, source, block_hashes: list[bytes]) -> Match:
        """`source`'s longest prefix of `block_hashes` held in any medium (the fastest one
        counted for each block)."""
        s = self._sources.get(source)
        if s is None:
            return Match()
        device, host, shared = s.held["device"], s.held["host"], s.held["shared"]
        predicted, now = s.predicted, time.monotonic()
        n = [0, 0, 0]
        for h in block_hashes:
            k = key(h)
            if k in device or predicted.get(k, 0.0) > now:
                n[0] += 1
            elif k in host:
                n[1] += 1
            elif k in shared:
                n[2] += 1
            else:
                break
        return Match(sum(n), *n)
