"""The KV-transfer store as a Ray actor: the directory, leases, capacity and metrics.

Bytes never pass through it. A producer registers a transfer; the store then calls the
producer's `take_export(transfer_id)`, so the returned object — written to the object store
by the producer's process — is *owned by the store* and outlives a dead producer. Consumers
get the ObjectRef from `lookup` and read the bytes straight from the object store.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray
from ray.util import metrics

from kvstore.directory import StoreFullError, TransferDirectory
from kvstore.shards import is_shard_of
from kvstore.shared_directory import SharedBlock, SharedDirectory

logger = logging.getLogger(__name__)

STORE_NAMESPACE = "pdserve"
# The owner of shared-tier blocks the store copied from a leaving replica, and how long the
# copies may take (a leaving replica waits for them; a tier of a few GB copies in seconds).
ADOPTED = "kv-store"
ADOPT_BOUND_S = 20.0


class KVStore:
    """Actor body (created with `create_store`, nowhere else)."""

    def __init__(self, lease_s: float = 120.0, max_bytes: int | None = None, max_transfers: int | None = None,
                 sweep_interval_s: float = 1.0) -> None:
        self.directory = TransferDirectory(lease_s, max_bytes, max_transfers)
        self.sweep_interval_s = sweep_interval_s
        self._sweeper: asyncio.Task | None = None
        self._live = metrics.Gauge("pdserve_kv_store_live_transfers", "KV transfers registered and not yet released")
        self._bytes = metrics.Gauge("pdserve_kv_store_live_bytes", "Bytes of live KV transfers")
        self._latency = metrics.Histogram(
            "pdserve_kv_transfer_latency_seconds", "Register to release of a KV transfer",
            boundaries=[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120],
        )
        self._transfer_bytes = metrics.Counter("pdserve_kv_transfer_bytes_total", "Bytes of KV transferred")
        # Consumers waiting in `lookup` for a registration still on its way.
        self._waiters: dict[str, asyncio.Event] = {}
        # The shared KV tier's directory (kvstore.shared_tier), made by the first replica that
        # opens it.
        self.shared: SharedDirectory | None = None

    def _settle(self, transfer_id: str) -> None:
        """Wake the lookups waiting for `transfer_id` (registered, rejected or released)."""
        event = self._waiters.pop(transfer_id, None)
        if event is not None:
            event.set()

    def _ensure_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)  # a periodic timer, not synchronisation
            await self.sweep()

    def _update_gauges(self) -> None:
        stats = self.directory.stats()
        self._live.set(stats.live_transfers)
        self._bytes.set(stats.live_bytes)

    async def register(self, transfer_id: str, owner: str, producer, nbytes: int, num_tokens: int,
                       meta: dict | None = None, pull: bool = True, refs: list | None = None) -> dict:
        """Record a transfer. With `pull` (object-store transport) the store takes the export
        from the producer, becoming the object's owner; with `refs` the producer already put
        the object and the store only borrows the reference; otherwise the producer keeps the
        bytes and the entry says where they are. Producers do not wait for the answer
        ({"ok": True} or {"ok": False, "error": ...}): a refusal is recorded, and the
        consumer's lookup reports it."""
        self._ensure_sweeper()
        try:
            entry = self.directory.put(transfer_id, owner, nbytes, num_tokens, location=None,
                                       meta={**(meta or {}), "pull": pull})
        except (StoreFullError, ValueError) as e:
            if not self.directory.is_closed(transfer_id):
                self.directory.reject(transfer_id, str(e))
            if producer is not None:
                producer.drop_export.remote(transfer_id)  # nobody will fetch what it holds
            self._settle(transfer_id)
            return {"ok": False, "error": str(e)}
        entry.meta["producer"] = producer
        if refs:
            entry.location = refs[0]
        elif pull:
            # The store is the caller, hence the owner, of the exported object.
            entry.location = producer.take_export.remote(transfer_id)
        self._update_gauges()
        self._settle(transfer_id)
        return {"ok": True}

    async def abandon(self, transfer_id: str, reason: str) -> None:
        """The producer could not export `transfer_id` (it will never be registered)."""
        if self.directory.lookup(transfer_id) is None and not self.directory.is_closed(transfer_id):
            self.directory.reject(transfer_id, reason)
        self._settle(transfer_id)

    async def lookup(self, transfer_id: str, wait_s: float = 0.0) -> dict | None:
        """Where a transfer's bytes are. A registration may still be on its way (producers
        do not wait for theirs): wait up to `wait_s` for it. None if it is unknown (released,
        expired, or never registered in time); {"error": reason} if it was refused."""
        entry = self.directory.lookup(transfer_id)
        if entry is None and wait_s > 0 and not self.directory.is_closed(transfer_id):
            event = self._waiters.setdefault(transfer_id, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), wait_s)
            except asyncio.TimeoutError:
                if self._waiters.get(transfer_id) is event and not event.is_set():
                    self._waiters.pop(transfer_id)
            entry = self.directory.lookup(transfer_id)
        if entry is None:
            reason = self.directory.rejection(transfer_id)
            return {"error": reason} if reason is not None else None
        # Wrapped in a list so Ray passes the reference instead of resolving it here.
        meta = {k: v for k, v in entry.meta.items() if k != "producer"}
        return {"refs": [entry.location], "num_tokens": entry.num_tokens, "nbytes": entry.nbytes,
                "producer": entry.meta["producer"], "meta": meta}

    async def _forget(self, entries) -> None:
        """Producer-held exports nobody will fetch any more: have their producers drop them
        (a dead producer has nothing left to drop)."""
        drops = [e.meta["producer"].drop_export.remote(e.transfer_id)
                 for e in entries if not e.meta.get("pull", True)]
        await asyncio.gather(*drops, return_exceptions=True)

    async def release(self, transfer_id: str) -> bool:
        """Release a transfer, and every shard of it (tensor-parallel P/D, kvstore.shards)."""
        entries = self.directory.release_with_shards(transfer_id)
        for tid in [t for t in self._waiters if t == transfer_id or is_shard_of(t, transfer_id)]:
            self._settle(tid)
        if entries:
            await self._forget(entries)
            for entry in entries:
                self._latency.observe(time.monotonic() - entry.created)
                self._transfer_bytes.inc(entry.nbytes)
            self._update_gauges()
        return bool(entries)

    async def sweep(self, advance_s: float = 0.0) -> list[str]:
        if self.shared is not None:
            self.shared.sweep(advance_s)
        entries = self.directory.sweep(advance_s)
        await self._forget(entries)
        expired = [e.transfer_id for e in entries]
        if expired:
            logger.info("KV store: %d transfers expired unclaimed", len(expired))
            self._update_gauges()
        return expired

    async def count_owned(self, owner: str) -> int:
        """Live transfers a producer exported (a draining prefill replica waits for 0)."""
        return self.directory.count_owned(owner)

    async def stats(self) -> dict:
        s = self.directory.stats()
        return {"live_transfers": s.live_transfers, "bytes": s.live_bytes, "registered": s.registered,
                "released": s.released, "expired": s.expired, "rejected_full": s.rejected_full}

    # ---- the shared KV tier (kvstore.shared_tier) ----------------------------------------
    async def shared_open(self, capacity_bytes: int, lease_s: float = 600.0) -> int:
        """Hold a shared tier of `capacity_bytes` (cluster-wide); the first replica to open it
        sets its size, later ones join it. Returns the size in force."""
        self._ensure_sweeper()
        if self.shared is None:
            self.shared = SharedDirectory(capacity_bytes, lease_s)
        elif capacity_bytes != self.shared.capacity_bytes:
            logger.warning("shared KV tier: a replica asked for %d bytes; the tier holds %d (set by the "
                           "first replica)", capacity_bytes, self.shared.capacity_bytes)
        return self.shared.capacity_bytes

    async def shared_put(self, block_hash: bytes, location: list, nbytes: int, crc32: int, shape: tuple,
                         dtype: str, owner: str) -> None:
        """Register one block whose bytes `owner` put in the object store (`location`: [ref],
        borrowed from then on). Callers do not wait: a block not held is just not found later."""
        if self.shared is not None:
            self.shared.put(block_hash, SharedBlock(location, nbytes, crc32, tuple(shape), dtype, owner, 0.0))

    async def shared_get(self, block_hashes: list[bytes]) -> list[dict | None]:
        """Where each block's bytes are, and what they must match (None: not held)."""
        if self.shared is None:
            return [None] * len(block_hashes)
        return [None if b is None else {"refs": b.location, "nbytes": b.nbytes, "crc32": b.crc32,
                                        "shape": b.shape, "dtype": b.dtype, "owner": b.owner}
                for b in self.shared.get(block_hashes)]

    async def shared_changes(self, version: int) -> dict | None:
        """What the directory changed after `version` (SharedDirectory.changes_since)."""
        return None if self.shared is None else self.shared.changes_since(version)

    async def shared_drop(self, block_hashes: list[bytes]) -> int:
        return len(self.shared.drop(block_hashes)) if self.shared is not None else 0

    async def shared_adopt(self, owner: str, bound_s: float = ADOPT_BOUND_S) -> dict[str, int]:
        """A replica leaves on purpose: copy the blocks it put into objects this actor owns, so
        they outlive its process. (Ray owns an object by the process that put it, and 2.56
        removed ray.put's `_owner`, so ownership moves by a copy, on the same node when the
        store and the replica share one.) A block not copied within `bound_s` is dropped."""
        if self.shared is None:
            return {"adopted": 0, "dropped": 0}
        blocks = self.shared.owned_by(owner)

        async def copy(block_hash: bytes, block) -> bool:
            data = await block.location[0]
            return self.shared.relocate(block_hash, [ray.put(data)], ADOPTED, owner)

        tasks = [asyncio.ensure_future(copy(h, b)) for h, b in blocks]
        done, pending = await asyncio.wait(tasks, timeout=bound_s) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        adopted = sum(1 for t in done if t.exception() is None and t.result())
        # What was not copied (its bytes gone, or the bound passed) goes before a reader finds it.
        dropped = len(self.shared.drop_owner(owner))
        logger.info("shared KV tier: %d blocks of %s adopted, %d dropped", adopted, owner, dropped)
        return {"adopted": adopted, "dropped": dropped}

    async def shared_drop_owner(self, owner: str) -> int:
        """A replica leaves: its objects die with its process, so its entries go first."""
        return len(self.shared.drop_owner(owner)) if self.shared is not None else 0

    async def shared_stats(self) -> dict:
        return self.shared.stats() if self.shared is not None else {}


def store_name(app_name: str) -> str:
    return f"pdserve-kv-store-{app_name}"


def create_store(app_name: str | None = None, detached: bool = False, **store_kwargs):
    """The one place a KV store actor is created.

    With `app_name`: the app's named store (namespace "pdserve"), got if it exists, so every
    replica of the app that asks first or concurrently shares one; `detached` makes it outlive
    its creator (a Serve app: no replica's fate decides its life, `remove_app_store` ends it).
    Without: an anonymous store owned by the caller (plain-actor P/D, tests, benchmarks)."""
    opts = {"num_cpus": 0, "max_concurrency": 1000}
    if app_name is not None:
        opts.update(name=store_name(app_name), namespace=STORE_NAMESPACE, get_if_exists=True)
        if detached:
            opts["lifetime"] = "detached"
            # Not in the creator's placement group: a tensor- or data-parallel replica's group
            # captures its child actors, and Serve removes the group (and every actor in it)
            # when it stops the replica. A store made by such a replica would die with it.
            opts["scheduling_strategy"] = "DEFAULT"
    return ray.remote(KVStore).options(**opts).remote(**store_kwargs)


def app_store(app_name: str, **store_kwargs):
    """The Serve app's store (detached; created by whichever caller comes first)."""
    return create_store(app_name, detached=True, **store_kwargs)


def find_app_store(app_name: str):
    """The app's store if it exists, else None (never creates one)."""
    try:
        return ray.get_actor(store_name(app_name), namespace=STORE_NAMESPACE)
    except ValueError:
        return None


def remove_app_store(app_name: str) -> bool:
    """End the app's store (with the app); False if there was none."""
    store = find_app_store(app_name)
    if store is None:
        return False
    ray.kill(store)
    return True
