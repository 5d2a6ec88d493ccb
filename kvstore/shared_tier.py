"""The shared KV tier (the cluster's KV cache): a prefix one replica computed is loaded by
another instead of computed again (docs/kv_cache.md#shared-tier).

The scheduler side is the host tier's (engine.kv_offload.connector): the same choice of full
blocks to store, within the same per-step budget, and of consecutive whole blocks to load past
the local hit. What differs is where blocks live:

- store: the worker side puts each block's bytes in Ray's object store from this replica's
  process and registers hash -> [ObjectRef] with the app's KV store actor
  (kvstore.shared_directory; bounded in bytes, LRU, leased). Nothing waits for the answer.
- lookup: in a mirror of the directory's key set, refreshed by a background thread
  (kvstore.shared_mirror), never by the engine thread.
- load: asynchronous. The request waits in WAITING_FOR_REMOTE_KVS while a thread asks the
  store where the blocks are and fetches them, within `fetch_timeout_s`; the blocks are
  checked (crc32, shape, dtype) and written into the request's blocks on the engine thread
  before a step. Any failure (a block gone, refused, late, or a dead store) recomputes the
  prompt: never tokens from wrong KV, never a hang.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
import torch

from engine.config import EngineConfig
from engine.core import resolve_device
from engine.errors import ParameterError
from engine.kv_cache.events import SHARED
from engine.kv_cache.hybrid import kv_groups
from engine.kv_connector import GroupBlockIds, KVConnectorBase, KVConnectorFactory, KVConnectorRole
from engine.kv_offload.connector import (
    EVICT,
    STORE_BYTES_PER_STEP,
    LoadSpec,
    OffloadConnector,
    OffloadMetadata,
)
from engine.kv_offload.factory import block_bytes
from engine.kv_offload.host_pool import RefusedBlock, checksum
from engine.kv_offload.multi import MultiConnector
from engine.kv_transfer_params import KVTransferParams
from engine.models.arch import load_arch
from engine.models.loader import resolve_dtype
from engine.request import Request
from engine.sched.output import SchedulerOutput
from kvstore.shared_mirror import SharedIndex, start_polling

logger = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 10.0
_OPEN_TIMEOUT_S = 30.0


@dataclass
class SharedMetadata(OffloadMetadata):
    # Requests that finished (e.g. aborted) while their load was in flight: their blocks are
    # free again, so a fetch that completes later must not be written.
    abandoned: list[str] = field(default_factory=list)


class SharedTierConnector(OffloadConnector):
    """One side of a replica's view of the shared tier."""

    def __init__(self, role: KVConnectorRole, block_size: int, store_blocks_per_step: int, store,
                 replica_id: str, fetch_timeout_s: float = FETCH_TIMEOUT_S) -> None:
        self.store = store
        self.replica_id = replica_id
        self.fetch_timeout_s = fetch_timeout_s
        # The capacity is the directory's (cluster-wide), not this replica's.
        super().__init__(role, block_size, 0, 0, store_blocks_per_step)
        self._abandoned: list[str] = []
        # worker side: fetches done by their threads, written by the engine thread
        self._lock = threading.Lock()
        self._in_flight: dict[str, LoadSpec] = {}
        self._fetched: dict[str, tuple[LoadSpec, list | Exception]] = {}
        self._wakeup: Callable[[], None] | None = None
        self.stats = {"shared_stores": 0, "shared_loads": 0, "shared_hit_tokens": 0, "shared_refused": 0,
                      "shared_load_failures": 0, "shared_bytes_out": 0, "shared_bytes_in": 0}
        if role == KVConnectorRole.SCHEDULER:
            start_polling(self, self.index, store)

    def _make_index(self, capacity_blocks: int) -> SharedIndex:
        return SharedIndex(self.block_size)

    def _make_pool(self, capacity_bytes: int) -> None:
        return None  # the bytes are in the object store

    # ---- scheduler side -----------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SharedMetadata:
        meta = super().build_connector_meta(scheduler_output)
        abandoned, self._abandoned = self._abandoned, []
        return SharedMetadata(meta.loads, meta.ops, abandoned)

    def request_finished(self, request: Request, block_ids: GroupBlockIds) -> tuple[bool, KVTransferParams | None]:
        if request.request_id in self._loading:
            self._abandoned.append(request.request_id)
        return super().request_finished(request, block_ids)

    def kv_held(self) -> dict[str, tuple[bytes, ...]]:
        return {SHARED: self.index.hashes()} if self.index is not None else {}

    # ---- worker side --------------------------------------------------------------------
    def set_wakeup(self, callback: Callable[[], None]) -> None:
        self._wakeup = callback

    def start_load_kv(self, metadata: SharedMetadata | None) -> None:
        """Forget abandoned loads, start new fetches, and write the fetched ones (on the engine
        thread, between steps, so a write never races a forward pass)."""
        if metadata is not None:
            with self._lock:
                for rid in metadata.abandoned:
                    self._in_flight.pop(rid, None)
                    self._fetched.pop(rid, None)
            for spec in metadata.loads:
                with self._lock:
                    self._in_flight[spec.request_id] = spec
                threading.Thread(target=self._fetch, args=(spec,), name="shared-kv-fetch", daemon=True).start()
        with self._lock:
            done, self._fetched = self._fetched, {}
        for rid, (spec, result) in done.items():
            self._write(rid, spec, result)

    def _fetch(self, spec: LoadSpec) -> None:
        try:
            result = self._fetch_blocks(spec)
        except Exception as e:  # whatever went wrong, the request computes its prompt
            result = e
        with self._lock:
            if self._in_flight.pop(spec.request_id, None) is spec:
                self._fetched[spec.request_id] = (spec, result)
        if self._wakeup is not None:
            self._wakeup()

    def _fetch_blocks(self, spec: LoadSpec) -> list[torch.Tensor]:
        """Every block of the load, checked, or an exception: nothing partial."""
        hashes = [h for h, _ in spec.blocks]
        entries = ray.get(self.store.shared_get.remote(hashes), timeout=self.fetch_timeout_s)
        if any(e is None for e in entries):
            raise RefusedBlock("no longer in the shared tier")
        datas = ray.get([e["refs"][0] for e in entries], timeout=self.fetch_timeout_s)
        paged = self._paged
        bad = []
        for h, entry, data in zip(hashes, entries, datas):
            if not (isinstance(data, torch.Tensor) and tuple(data.shape) == tuple(entry["shape"]) == paged.block_shape
                    and str(data.dtype) == entry["dtype"] == str(paged.dtype) and checksum(data) == entry["crc32"]):
                bad.append(h)
        if bad:
            self.store.shared_drop.remote(bad)  # nobody should load them again
            raise RefusedBlock(f"{len(bad)} block(s) do not match their crc32, shape or dtype")
        return datas

    def _write(self, rid: str, spec: LoadSpec, result: list | Exception) -> None:
        if isinstance(result, Exception):
            if isinstance(result, RefusedBlock):
                self.stats["shared_refused"] += 1
            self.stats["shared_load_failures"] += 1
            logger.warning("shared KV load for %s failed; the request computes its prompt: %s", rid, result)
            self._finished.failed_recving[rid] = f"shared KV load failed: {result}"
            return
        paged = self._paged
        for (_, block_id), data in zip(spec.blocks, result):
            paged.copy_in(block_id, data)
        self._finished.finished_recving.add(rid)
        self.stats["shared_loads"] += len(result)
        self.stats["shared_hit_tokens"] += len(result) * self.block_size
        self.stats["shared_bytes_in"] += len(result) * paged.block_bytes

    def wait_for_save(self, metadata: SharedMetadata | None) -> None:
        """Copy the step's new full blocks out, put each in the object store, register it.
        The directory evicts on its own, so there are no evictions to follow here."""
        if metadata is None:
            return
        stores = [(h, b) for h, b in metadata.ops if b != EVICT]
        if not stores:
            return
        paged = self._paged
        copies = [paged.copy_out(block_id) for _, block_id in stores]
        paged.synchronize()
        for (block_hash, _), data in zip(stores, copies):
            # Wrapped in a list so Ray passes the reference; the store borrows it, and the
            # pending call holds it until the store has it.
            self.store.shared_put.remote(block_hash, [ray.put(data)], paged.block_bytes, checksum(data),
                                         tuple(data.shape), str(data.dtype), self.replica_id)
            self.stats["shared_stores"] += 1
            self.stats["shared_bytes_out"] += paged.block_bytes

    def transfer_stats(self) -> dict[str, int | float]:
        return dict(self.stats)


@dataclass(frozen=True)
class SharedTierFactory:
    """Makes each side of the shared tier, composed after `inner`'s connector when there is
    one (a P/D transfer wins over the shared tier for its prompt). It carries the store's
    actor handle, so it is built and used in the replica's process (not spawn-safe)."""

    block_size: int
    store_blocks_per_step: int
    store: object
    replica_id: str
    fetch_timeout_s: float = FETCH_TIMEOUT_S
    inner: KVConnectorFactory | None = None
    host: KVConnectorFactory | None = None  # the engine's host tier, asked before this one
    provides_shared_tier = True  # read by EngineCore, which otherwise says the tier is off

    def with_host_tier(self, host: KVConnectorFactory) -> SharedTierFactory:
        """Called by the engine when it adds its host tier (engine.kv_offload.factory): a block
        both tiers hold is a memcpy from host memory, a fetch from the object store here."""
        return dataclasses.replace(self, host=host)

    def __call__(self, role: KVConnectorRole) -> KVConnectorBase:
        tier = SharedTierConnector(role, self.block_size, self.store_blocks_per_step, self.store,
                                   self.replica_id, self.fetch_timeout_s)
        # First match wins (MultiConnector): P/D, then the host tier, then the shared tier.
        connectors = [f(role) for f in (self.inner, self.host) if f is not None] + [tier]
        return connectors[0] if len(connectors) == 1 else MultiConnector(role, connectors)



def with_shared_tier(config: EngineConfig, store, replica_id: str, factory: KVConnectorFactory | None,
                     fetch_timeout_s: float = FETCH_TIMEOUT_S) -> KVConnectorFactory | None:
    """`factory` with the shared tier added when `config.kv_shared_tier` asks for one; opens
    the tier in the app's store (`store`) on the way."""
    tier = config.kv_shared_tier
    if tier is None:
        return factory
    if store is None:
        raise ValueError("kv_shared_tier_size needs the app's KV store actor (store=...)")
    mc, cc = config.model, config.cache
    arch = load_arch(mc.model)
    spec = config.speculative
    groups = kv_groups(arch, disabled=cc.disable_hybrid_kv_cache_manager,
                       draft_model=bool(spec and spec.method == "draft_model"))
    if groups.main_window or groups.hybrid:
        raise ParameterError("kv_shared_tier_size", f"kv_shared_tier_size shares whole prefixes; "
                             f"{arch.architecture} has sliding-window layers: pass "
                             "disable_hybrid_kv_cache_manager=True, or leave the tier off")
    per_block = block_bytes(arch, resolve_dtype(mc.dtype, arch, resolve_device(mc.device)), cc.block_size)
    if tier.size_bytes < per_block:
        raise ParameterError("kv_shared_tier_size", f"kv_shared_tier_size={tier.size_gb:g} GiB holds no KV "
                             f"block of this model ({per_block} bytes each); give at least "
                             f"{per_block / 2**30:.6f} GiB")
    # Waited for (once, as the replica starts): the tier must exist before blocks go to it.
    ray.get(store.shared_open.remote(tier.size_bytes), timeout=_OPEN_TIMEOUT_S)
    return SharedTierFactory(cc.block_size, max(1, STORE_BYTES_PER_STEP // per_block), store, replica_id,
                             fetch_timeout_s, factory)
