"""A replica's mirror of the shared KV tier's key set (kvstore.shared_directory), kept for the
scheduler side of kvstore.shared_tier.

Admission looks a prompt up here, in memory: the engine thread never waits on the store
actor. A background thread asks the store every POLL_INTERVAL_S what the directory changed
since the version it last saw, and applies the changes (or the whole key set, when it fell
too far behind). A stale mirror only costs
time: a block it still lists but the directory dropped fails its load, and the request
computes its prompt instead.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict

import ray

from engine.kv_cache.events import SHARED, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.2
POLL_TIMEOUT_S = 5.0
# Blocks this replica stored that the directory has not listed yet (in flight, or refused as
# a duplicate of another replica's): not stored twice meanwhile, and bounded.
_MAX_PENDING = 100_000


class SharedIndex:
    """What the HostIndex is to the host tier (engine.kv_offload.host_index), for blocks held
    cluster-wide: the directory, not this replica, decides what is evicted."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._lock = threading.Lock()  # the poller replaces _held and tells events
        self._held: frozenset[bytes] = frozenset()
        self._told: frozenset[bytes] = frozenset()  # what the events have said so far
        self._pending: OrderedDict[bytes, None] = OrderedDict()
        self._events: list[KVEvent] = []
        self.version = -1  # the directory's, as of the last refresh

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._held or block_hash in self._pending

    def __len__(self) -> int:
        return len(self._held)

    def hashes(self) -> tuple[bytes, ...]:
        return tuple(self._held)

    def prefix_hits(self, block_hashes: list[bytes], start: int, stop: int) -> int:
        """How many of block_hashes[start:stop], consecutively from `start`, the directory
        listed (not those only stored here: they may not have arrived)."""
        held, n = self._held, 0
        for h in block_hashes[start:stop]:
            if h not in held:
                break
            n += 1
        return n

    def touch(self, block_hashes) -> None:
        """A load's lookup touches the blocks in the directory itself."""

    def add(self, block_hash: bytes, parent: bytes | None) -> list[bytes]:
        """A block this replica stores; the directory evicts, so nothing is evicted here."""
        self._pending[block_hash] = None
        if len(self._pending) > _MAX_PENDING:
            self._pending.popitem(last=False)
        return []

    def remove(self, block_hashes) -> list[bytes]:
        """Stop offering blocks whose load failed (the worker side told the directory why)."""
        gone = set(block_hashes)
        with self._lock:
            self._held = self._held - gone
        return []

    def apply(self, changes: dict) -> None:
        """An answer of SharedDirectory.changes_since."""
        if "keys" in changes:
            self.refresh(changes["version"], changes["keys"])
        else:
            self.refresh(changes["version"], (self._told - set(changes["removed"])) | set(changes["added"]))

    def refresh(self, version: int, keys) -> None:
        """The directory's key set as of `version`: the mirror becomes it, and the events say
        what changed since they last spoke."""
        new = frozenset(keys)
        with self._lock:
            added, removed = new - self._told, self._told - new
            if removed:
                self._events.append(BlockRemoved(tuple(removed), SHARED))
            if added:
                self._events.append(BlockStored(tuple(added), None, len(added) * self.block_size, SHARED))
            self._held = self._told = new
            self.version = version
        for h in added:
            self._pending.pop(h, None)

    def take_events(self) -> list[KVEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events


def start_polling(owner: object, index: SharedIndex, store, interval_s: float = POLL_INTERVAL_S) -> threading.Thread:
    """Keep `index` in step with the store's directory for as long as `owner` lives (the
    thread holds it weakly and ends once it is collected, or once Ray is shut down). An
    unreachable store empties the mirror, so no load is even tried until it answers again."""
    alive = weakref.ref(owner)

    def poll() -> None:
        failing = False
        while alive() is not None and ray.is_initialized():
            try:
                answer = ray.get(store.shared_changes.remote(index.version), timeout=POLL_TIMEOUT_S)
            except Exception as e:  # a dead or hung store: no shared hits until it is back
                if not failing:
                    logger.warning("shared KV tier: the store does not answer (%s); prompts compute", e)
                failing = True
                index.refresh(-1, [])
            else:
                failing = False
                if answer is not None:
                    index.apply(answer)
            time.sleep(interval_s)  # a polling period, not synchronisation

    thread = threading.Thread(target=poll, name="shared-kv-mirror", daemon=True)
    thread.start()
    return thread
