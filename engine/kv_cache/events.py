"""KV cache events: what an engine tells the cluster about the prefix blocks it holds (vLLM's
BlockStored / BlockRemoved / AllBlocksCleared, docs/kv_cache.md#kv-events).

A block is named by its chained prefix hash (engine.kv_cache.hashing: SHA-256 over the parent
hash, the tokens and the cache salt / LoRA / image keys), so equal prefixes have equal hashes
on every replica. Consumers (the data-parallel client, the replica, the request router) keep
an index of who holds what (engine.kv_cache.prefix_index) and never need the bytes.

`medium` says where the block lives: the engine's own pool ("device", the GPU or, on CPU, the
engine's KV tensors), a replica's host tier ("host") or the cluster's shared tier ("shared").
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

DEVICE = "device"
HOST = "host"
SHARED = "shared"
MEDIA = (DEVICE, HOST, SHARED)


@dataclass(frozen=True)
class BlockStored:
    """Full blocks now cached, in prefix order: `block_hashes[0]`'s parent is
    `parent_block_hash` (None: the first block of a prompt), each next one's the previous."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    num_tokens: int  # tokens in these blocks (block_size each)
    medium: str = DEVICE


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    medium: str = DEVICE


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every block of `medium` was dropped (a prefix-cache reset)."""

    medium: str = DEVICE


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    """The events of one engine step, numbered: a consumer that sees a gap in `seq` lost
    events and asks for a snapshot instead."""

    seq: int
    events: tuple[KVEvent, ...]


@dataclass(frozen=True)
class KVSnapshot:
    """Everything a source holds now, per medium: what a consumer rebuilds from when it
    (re)joins or lost events. `seq` is the last batch it includes."""

    seq: int
    held: dict[str, tuple[bytes, ...]] = field(default_factory=dict)


class KVEventLog:
    """The engine side: collects a step's events and keeps the last `max_batches` numbered
    batches. `snapshot` is a callable that lists what the engine holds now (per medium), for a
    consumer that fell behind the log."""

    def __init__(self, snapshot, max_batches: int = 4096) -> None:
        self._snapshot = snapshot
        self._pending: list[KVEvent] = []
        self._batches: deque[KVEventBatch] = deque(maxlen=max_batches)
        self.seq = 0

    def record(self, event: KVEvent) -> None:
        self._pending.append(event)

    def end_step(self) -> KVEventBatch | None:
        """Number this step's events as one batch (None when there were none)."""
        if not self._pending:
            return None
        self.seq += 1
        batch = KVEventBatch(self.seq, tuple(self._pending))
        self._pending = []
        self._batches.append(batch)
        return batch

    def since(self, seq: int) -> list[KVEventBatch] | KVSnapshot:
        """The batches after `seq`, or a snapshot when some of them already left the log (or
        `seq` is from before a restart: ahead of this log)."""
        self.end_step()
        if seq > self.seq or (self._batches and self._batches[0].seq > seq + 1) or (
                not self._batches and seq < self.seq):
            return KVSnapshot(self.seq, self._snapshot())
        return [b for b in self._batches if b.seq > seq]


class EngineKVEvents:
    """One engine core's events: its prefix cache's (the KV cache manager's main pool) and its
    KV connector's tiers' (`take_kv_events` / `kv_held`, engine.kv_connector), numbered per
    step."""

    def __init__(self, kv_cache_manager, connector=None, max_batches: int = 4096) -> None:
        self._manager, self._connector = kv_cache_manager, connector
        self.log = KVEventLog(self.held, max_batches)
        self._snapshot: KVSnapshot | None = None
        kv_cache_manager.publish_events(self.log)

    def held(self) -> dict[str, tuple[bytes, ...]]:
        held = {DEVICE: self._manager.cached_hashes()}
        if self._connector is not None:
            held.update(self._connector.kv_held())
        return held

    def end_step(self) -> KVEventBatch | None:
        if self._connector is not None:
            for event in self._connector.take_kv_events():
                self.log.record(event)
        return self.log.end_step()

    def since(self, seq: int) -> list[KVEventBatch] | KVSnapshot:
        self.end_step()
        return self.log.since(seq)

    def snapshot(self) -> KVSnapshot:
        """What the engine holds now; built again only when events moved the log (a serving
        replica asks every routing-stats period, mostly of an idle or unchanged cache)."""
        self.end_step()
        if self._snapshot is None or self._snapshot.seq != self.log.seq:
            self._snapshot = KVSnapshot(self.log.seq, self.held())
        return self._snapshot
