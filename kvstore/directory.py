"""The transfer directory: which KV exports exist, where, how big, until when.

Pure Python with an injectable clock; `kvstore.store_actor` wraps it in a Ray actor. The
directory holds handles (e.g. Ray ObjectRefs), never the bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.shards import base_transfer_id, is_shard_of


class StoreFullError(RuntimeError):
    """Raised when a transfer would exceed the store's capacity."""


@dataclass
class TransferEntry:
    transfer_id: str
    owner: str  # replica id of the producer
    nbytes: int
    num_tokens: int
    location: object  # what the transport needs to fetch the bytes (ObjectRef, peer address, ...)
    created: float
    deadline: float
    meta: dict = field(default_factory=dict)


@dataclass
class DirectoryStats:
    live_transfers: int
    live_bytes: int
    registered: int
    released: int
    expired: int
    rejected_full: int


# How long a released or expired id stays closed. A release that precedes its registration
# comes from a caller that gave up seconds earlier; a lookup of a released or expired one comes
# from a consumer that was about to load it.
_TOMBSTONE_S = 60.0
_MAX_TOMBSTONES = 100_000


class TransferDirectory:
    def __init__(
        self,
        lease_s: float = 120.0,
        max_bytes: int | None = None,
        max_transfers: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self.max_bytes = max_bytes
        self.max_transfers = max_transfers
        self._clock = clock
        self._entries: dict[str, TransferEntry] = {}
        # Ids released or expired: a later registration is refused, so it cannot leak (the
        # requester gave up while the producer was still exporting), and a consumer looking one
        # up learns at once that it is gone instead of waiting for a registration.
        self._tombstones: dict[str, float] = {}
        # Ids whose registration was refused or abandoned by the producer, with the reason (a
        # consumer looking one up learns why, instead of waiting for it).
        self._rejected: dict[str, tuple[float, str]] = {}
        self._bytes = 0
        self._counts = {"registered": 0, "released": 0, "expired": 0, "rejected_full": 0}

    def put(self, transfer_id: str, owner: str, nbytes: int, num_tokens: int, location: object,
            meta: dict | None = None, lease_s: float | None = None) -> TransferEntry:
        if transfer_id in self._entries:
            raise ValueError(f"transfer_id {transfer_id!r} is already registered")
        if self._tombstones.pop(transfer_id, None) is not None:
            raise ValueError(f"transfer_id {transfer_id!r} was released before it was registered")
        base = base_transfer_id(transfer_id)
        if base != transfer_id and base in self._tombstones:
            raise ValueError(f"transfer {base!r} was released before its shard {transfer_id!r} was registered")
        if self.max_transfers is not None and len(self._entries) >= self.max_transfers:
            self._counts["rejected_full"] += 1
            raise StoreFullError(
                f"KV store is full: {len(self._entries)} live transfers (max_transfers={self.max_transfers})"
            )
        if self.max_bytes is not None and self._bytes + nbytes > self.max_bytes:
            self._counts["rejected_full"] += 1
            raise StoreFullError(
                f"KV store is full: {self._bytes} + {nbytes} bytes exceeds max_bytes={self.max_bytes}"
            )
        now = self._clock()
        entry = TransferEntry(transfer_id, owner, nbytes, num_tokens, location, now,
                              now + (lease_s if lease_s is not None else self.lease_s), dict(meta or {}))
        self._entries[transfer_id] = entry
        self._bytes += nbytes
        self._counts["registered"] += 1
        return entry

    def lookup(self, transfer_id: str) -> TransferEntry | None:
        return self._entries.get(transfer_id)

    def reject(self, transfer_id: str, reason: str) -> None:
        """Record that `transfer_id` will never be registered, and why."""
        self._rejected[transfer_id] = (self._clock() + _TOMBSTONE_S, reason)
        if len(self._rejected) > _MAX_TOMBSTONES:
            del self._rejected[next(iter(self._rejected))]

    def rejection(self, transfer_id: str) -> str | None:
        entry = self._rejected.get(transfer_id)
        return entry[1] if entry is not None else None

    def is_closed(self, transfer_id: str) -> bool:
        """Released, expired or rejected (or, for a tensor-parallel shard, its whole transfer
        was released): no registration of it will ever be accepted."""
        base = base_transfer_id(transfer_id)
        return transfer_id in self._tombstones or transfer_id in self._rejected or base in self._tombstones

    def release(self, transfer_id: str) -> TransferEntry | None:
        """Forget a transfer (its consumer has the bytes, or nobody will take them)."""
        entry = self._entries.pop(transfer_id, None)
        if entry is not None:
            self._bytes -= entry.nbytes
            self._counts["released"] += 1
        self._close(transfer_id)
        return entry

    def _close(self, transfer_id: str) -> None:
        self._tombstones.pop(transfer_id, None)  # re-inserted last: insertion order stays expiry order
        self._tombstones[transfer_id] = self._clock() + _TOMBSTONE_S
        if len(self._tombstones) > _MAX_TOMBSTONES:
            del self._tombstones[next(iter(self._tombstones))]

    def release_with_shards(self, transfer_id: str) -> list[TransferEntry]:
        """Release a transfer and every live shard of it (kvstore.shards): whoever releases a
        whole transfer does not know how many ranks exported it."""
        shards = [tid for tid in self._entries if is_shard_of(tid, transfer_id)]
        released = [self.release(transfer_id), *(self.release(tid) for tid in shards)]
        return [e for e in released if e is not None]

    def release_owner(self, owner: str) -> list[TransferEntry]:
        """Forget every transfer of a producer (e.g. when its bytes died with it)."""
        return [self.release(tid) for tid, e in list(self._entries.items()) if e.owner == owner]

    def count_owned(self, owner: str) -> int:
        """Live transfers of `owner`, its tensor-parallel ranks' shards included (a rank
        registers as "<owner>.rank<r>", kvstore.connector_factory)."""
        return sum(1 for e in self._entries.values() if e.owner == owner or e.owner.startswith(owner + ".rank"))

    def sweep(self, advance_s: float = 0.0) -> list[TransferEntry]:
        """Drop every transfer whose lease has passed (as of `advance_s` seconds from now,
        which lets tests and operators expire leases early); returns them."""
        now = self._clock() + advance_s
        # Tombstones share one TTL, so insertion order is expiry order.
        while self._tombstones and next(iter(self._tombstones.values())) <= now:
            del self._tombstones[next(iter(self._tombstones))]
        while self._rejected and next(iter(self._rejected.values()))[0] <= now:
            del self._rejected[next(iter(self._rejected))]
        expired = [e for e in self._entries.values() if e.deadline <= now]
        for e in expired:
            del self._entries[e.transfer_id]
            self._bytes -= e.nbytes
            self._counts["expired"] += 1
            self._close(e.transfer_id)
        return expired

    def stats(self) -> DirectoryStats:
        return DirectoryStats(len(self._entries), self._bytes, **self._counts)
