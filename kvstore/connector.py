"""The P/D KV connector: engine.kv_connector's contract implemented over a transport.

Producer: a request submitted with `KVTransferParams(do_remote_decode=True)` exports the KV of
its prompt in the step that computes the prompt's last chunk: the scheduler side names the
transfer then (complete params, never changed afterwards), and the worker side copies the KV
out after that step's forward pass and hands it to the transport (which registers it in the
store without waiting for it). So when the request's output leaves the engine, carrying those
params, the transfer is already on its way to the store.

Consumer: a request submitted with those params has its prompt reported as externally
computed; it waits in WAITING_FOR_REMOTE_KVS while the worker side fetches the bytes (off the
engine thread); they are written into its blocks between steps, and only then is it
scheduled. A failed fetch, or KV refused as malformed (kvstore.kv_io.check_kv: before any of it
is written, never cast), is an error for that request ("fail") or a local recompute of the
prompt ("recompute"); a request never runs on partial or wrong KV.

Release: a transfer a consumer request names is released exactly once: after its load (done
or failed), or when the request finishes without loading (aborted first, or its prompt found
in the local prefix cache). A one-rank consumer's worker side releases it. A tensor-parallel
consumer's ranks may read the same producer shard (kvstore.reshard), so no rank may release
what another still fetches: its scheduler side releases the whole transfer (every shard)
once every rank has reported the load, which the executor's merged report tells it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv_connector import (
    DEFAULT_LOAD_FAILURE_POLICY,
    LOAD_FAILURE_POLICIES,
    GroupBlockIds,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
)
from engine.kv_transfer_params import KVTransferParams
from engine.request import Request, RequestStatus
from engine.sched.output import KVConnectorOutput, SchedulerOutput
from kvstore.kv_io import REFUSAL_REASONS, MalformedKV, gather_kv, refusal_key, scatter_kv
from kvstore.reshard import ShardPiece, join_pieces, plan_pieces, readers
from kvstore.transports.base import KVTransport

logger = logging.getLogger(__name__)

ROLES = ("producer", "consumer", "both")


@dataclass(frozen=True)
class LoadSpec:
    request_id: str
    params: KVTransferParams
    block_ids: tuple[tuple[int, ...], ...]  # per KV cache group
    start: int  # first token position to fill (after the local prefix hit)
    end: int


@dataclass(frozen=True)
class SaveSpec:
    request_id: str
    params: KVTransferParams
    block_ids: tuple[tuple[int, ...], ...]  # per KV cache group


@dataclass
class PDConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # Consumer requests that finished before their load was reported done or failed: the
    # worker side drops the load (if any) and releases the transfer.
    abandoned: list[tuple[str, KVTransferParams]] = field(default_factory=list)
    # Transfers not needed at all (the local prefix cache covers them): release only.
    releases: list[KVTransferParams] = field(default_factory=list)


@dataclass
class _Load:
    spec: LoadSpec
    started: float
    pieces: tuple[ShardPiece, ...] = ()  # the producer shards this rank's heads come from
    shards: dict[int, object] = field(default_factory=dict)  # piece index -> tensor or exception
    result: object = None  # a list of tensors (one per piece), an exception, or None in flight


class PDConnector(KVConnectorBase):
    """One side (`side`) of the P/D connector of a replica whose P/D role is `pd_role`. Its
    worker side is rank `rank` of `tensor_parallel_size`; `num_kv_heads`: the model's KV heads
    (all ranks'), which a one-rank consumer reads from its cache."""

    def __init__(self, side: KVConnectorRole, pd_role: str, transport: KVTransport, replica_id: str,
                 block_size: int, load_failure_policy: str = DEFAULT_LOAD_FAILURE_POLICY,
                 tensor_parallel_size: int = 1, rank: int = 0, num_kv_heads: int | None = None) -> None:
        super().__init__(side)
        if tensor_parallel_size > 1 and num_kv_heads is None:
            raise ValueError("a tensor-parallel connector needs the model's num_kv_heads")
        if pd_role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {pd_role!r}")
        if load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"load_failure_policy must be one of {LOAD_FAILURE_POLICIES}, "
                             f"got {load_failure_policy!r}")
        self.pd_role = pd_role
        self.transport = transport
        self.replica_id = replica_id
        self.block_size = block_size
        self.tensor_parallel_size = tensor_parallel_size
        self.rank = rank
        self.num_kv_heads = num_kv_heads
        # Who releases a consumer's transfers (module docstring): the scheduler side of a
        # tensor-parallel consumer, else the worker side.
        self._scheduler_releases = tensor_parallel_size > 1
        self.kv_load_failure_policy = load_failure_policy
        # scheduler side
        self._meta = PDConnectorMetadata()
        self._local_hits: dict[str, int] = {}
        # Producer requests whose prompt is being computed: (prompt length, block ids so far
        # per KV cache group, the request's own params).
        self._producing: dict[str, tuple[int, list[list[int]], KVTransferParams]] = {}
        self._exported: dict[str, KVTransferParams] = {}  # saved, for request_finished
        self._loading: dict[str, KVTransferParams] = {}  # loads handed to the worker side, not reported yet
        self._loaded: set[str] = set()  # consumer requests whose transfer is dealt with
        # worker side
        self._kv_caches: list = []
        self._layer_groups: list[int] | None = None
        self._wakeup: Callable[[], None] | None = None
        self._lock = threading.Lock()  # _loads: fetch threads set results
        self._loads: dict[str, _Load] = {}
        self._finished = KVConnectorOutput()
        # Refusals (kvstore.kv_io) are load failures too; every reason is present from the start,
        # so a rate over its counter is defined before the first refusal.
        self.stats = {"exports": 0, "export_failures": 0, "loads": 0, "load_failures": 0, "bytes_out": 0,
                      "bytes_in": 0, "load_seconds": 0.0, **{refusal_key(r): 0 for r in REFUSAL_REASONS}}

    # ---- scheduler side -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        rid = request.request_id
        if self.pd_role == "producer" or params is None or not params.loads_remote_kv or rid in self._loaded:
            return 0, False
        n = params.num_tokens - num_computed_tokens
        lora = request.lora_request.lora_name if request.lora_request is not None else None
        if n > 0 and params.lora_name != lora:
            # KV of another adapter (or of the base model) would answer with the wrong model:
            # release the transfer and compute the prompt here, whatever the load policy.
            logger.warning("request %s: its KV was computed with LoRA %r, it runs %r: recomputing", rid,
                           params.lora_name, lora)
            n = 0
        if n <= 0:  # the local prefix cache already covers the transfer (or it is not ours)
            self._meta.releases.append(params)
            self._release(params, scheduler_side=True)
            self._loaded.add(rid)
            return 0, False
        self._local_hits[rid] = num_computed_tokens
        return n, True

    def update_state_after_alloc(self, request: Request, block_ids: GroupBlockIds, num_external_tokens: int) -> None:
        rid = request.request_id
        params = request.kv_transfer_params
        if self.pd_role != "consumer" and params is not None and params.do_remote_decode:
            lora = request.lora_request.lora_name if request.lora_request is not None else None
            self._producing[rid] = (request.num_prompt_tokens, [list(ids) for ids in block_ids],
                                    dataclasses.replace(params, lora_name=lora))
        if num_external_tokens <= 0:
            return
        start = self._local_hits.pop(rid)
        self._meta.loads.append(LoadSpec(rid, request.kv_transfer_params, tuple(tuple(ids) for ids in block_ids),
                                         start, start + num_external_tokens))
        self._loading[rid] = request.kv_transfer_params

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PDConnectorMetadata:
        """Adds a save for every producer whose prompt's last chunk runs in this step."""
        cached = scheduler_output.scheduled_cached_reqs
        computed = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
        window = cached.new_window_block_ids or [()] * len(cached.req_ids)
        for rid, new_blocks, new_window, num_computed in zip(cached.req_ids, cached.new_block_ids, window,
                                                             cached.num_computed_tokens):
            if rid in self._producing:
                groups = self._producing[rid][1]
                groups[0].extend(new_blocks)
                if len(groups) > 1:
                    # Blocks the window group freed since keep their old ids here: their
                    # positions are out of every window, so whatever the export copies from
                    # them is never read on the decode side either.
                    groups[1].extend(new_window)
                computed[rid] = num_computed
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            producing = self._producing.get(rid)
            if producing is None or computed.get(rid, 0) + n < producing[0]:
                continue
            num_prompt, block_ids, params = self._producing.pop(rid)
            transfer = KVTransferParams(
                # The requester may name the transfer up front, so it can release it even if
                # it never receives the prefill's result.
                transfer_id=params.transfer_id or f"{self.replica_id}-{rid}-{uuid.uuid4().hex[:8]}",
                num_tokens=num_prompt,
                block_size=self.block_size,
                source=self.replica_id,
                transport=self.transport.name,
                tensor_parallel_size=self.tensor_parallel_size,
                lora_name=params.lora_name,
            )
            self._exported[rid] = transfer
            self._meta.saves.append(SaveSpec(rid, transfer, tuple(tuple(ids) for ids in block_ids)))
        meta, self._meta = self._meta, PDConnectorMetadata()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The scheduler saw the worker side's report: those loads are over."""
        for rid in (*output.finished_recving, *output.failed_recving):
            params = self._loading.pop(rid, None)
            self._loaded.add(rid)
            if params is not None:  # every rank has reported: none reads the transfer any more
                self._release(params, scheduler_side=True)

    def request_finished(self, request: Request, block_ids: GroupBlockIds) -> tuple[bool, KVTransferParams | None]:
        rid = request.request_id
        params = request.kv_transfer_params
        self._local_hits.pop(rid, None)
        if params is not None and params.loads_remote_kv:
            if rid in self._loaded:
                self._loaded.discard(rid)  # released already, once its load was reported
            else:
                # Loading, or never got blocks: the worker side drops the load (and releases).
                self._loading.pop(rid, None)
                self._meta.abandoned.append((rid, params))
                self._release(params, scheduler_side=True)
        self._producing.pop(rid, None)
        transfer = self._exported.pop(rid, None)
        if transfer is None or request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                                      RequestStatus.FINISHED_STOPPED):
            # Aborted or failed: whoever named the transfer releases what was saved, if any.
            return False, None
        # The export was copied out in the step that computed it: the blocks may go now.
        return False, transfer

    def _release(self, params: KVTransferParams, scheduler_side: bool) -> None:
        """Release a consumer's transfer from the side that owns its release (module docstring)."""
        if scheduler_side == self._scheduler_releases:
            self.transport.release(params)

    # ---- worker side --------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list, layer_groups: list[int] | None = None) -> None:
        self._kv_caches = kv_caches
        self._layer_groups = layer_groups
        if self.num_kv_heads is None and kv_caches:
            self.num_kv_heads = kv_caches[0][0].shape[2]  # one rank: its cache holds every head

    def set_wakeup(self, callback: Callable[[], None]) -> None:
        self._wakeup = callback

    def start_load_kv(self, metadata: PDConnectorMetadata | None) -> None:
        """Drop abandoned loads, start new ones, and write every completed fetch into its
        blocks (between steps, on the engine thread)."""
        if metadata is not None:
            for rid, params in metadata.abandoned:
                with self._lock:
                    self._loads.pop(rid, None)
                self._release(params, scheduler_side=False)
            for params in metadata.releases:
                self._release(params, scheduler_side=False)
            for spec in metadata.loads:
                self._start_fetch(spec)
        with self._lock:
            done = {rid: load for rid, load in self._loads.items() if load.result is not None}
            for rid in done:
                del self._loads[rid]
        for rid, load in done.items():
            self._write(rid, load)

    def _start_fetch(self, spec: LoadSpec) -> None:
        """Fetch the producer shards that hold this rank's KV heads (kvstore.reshard); the load's
        result is their tensors once all arrived, or the first failure."""
        load = _Load(spec, time.monotonic())
        with self._lock:
            self._loads[spec.request_id] = load
        try:
            load.pieces = plan_pieces(self.num_kv_heads, spec.params.tensor_parallel_size, self.rank,
                                      self.tensor_parallel_size)
        except MalformedKV as e:
            load.result = e
            return

        def on_done(result, index: int, rid=spec.request_id):
            with self._lock:
                if self._loads.get(rid) is not load or load.result is not None:
                    return
                load.shards[index] = result
                if isinstance(result, BaseException):
                    load.result = result
                elif len(load.shards) == len(load.pieces):
                    load.result = [load.shards[i] for i in range(len(load.pieces))]
                else:
                    return
            if self._wakeup is not None:
                self._wakeup()

        shared = readers(self.num_kv_heads, spec.params.tensor_parallel_size, self.tensor_parallel_size)
        for index, piece in enumerate(load.pieces):
            params = dataclasses.replace(spec.params, transfer_id=piece.transfer_id(spec.params.transfer_id))
            # Other ranks of this decode read it too: a producer that hands each export out once
            # keeps it for them (kvstore.transports.torch_dist). One reader: the plain call.
            extra = {"readers": shared[piece.shard]} if shared[piece.shard] > 1 else {}
            self.transport.fetch_async(params, lambda result, i=index: on_done(result, i), **extra)

    def _write(self, rid: str, load: _Load) -> None:
        spec, result = load.spec, load.result
        try:
            if isinstance(result, BaseException):
                raise result
            k0 = self._kv_caches[0][0]
            # Each shard is checked against the heads its producer rank holds, and the joined KV
            # against the transfer's params and this cache, before any of it is written.
            kv = join_pieces(load.pieces, result, self.num_kv_heads, spec.params.tensor_parallel_size,
                             len(self._kv_caches), k0.shape[3], k0.dtype, spec.params.num_tokens)
            scatter_kv(self._kv_caches, spec.block_ids, spec.start, spec.end, self.block_size, kv,
                       spec.params.num_tokens, self._layer_groups)
        except Exception as e:  # never run on partial, missing or malformed KV
            if isinstance(e, MalformedKV):
                self.stats[refusal_key(e.reason)] += 1
            logger.warning("KV load for %s (transfer %s from %s) failed; the request will %s: %s", rid,
                           spec.params.transfer_id, spec.params.source, self.kv_load_failure_policy, e)
            self._finished.failed_recving[rid] = f"KV load failed: {e}"
            self.stats["load_failures"] += 1
        else:
            self._finished.finished_recving.add(rid)
            self.stats["loads"] += 1
            self.stats["bytes_in"] += kv.numel() * kv.element_size()
            self.stats["load_seconds"] += time.monotonic() - load.started
        self._release(spec.params, scheduler_side=False)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete whole requests before they are scheduled: nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: object, attn_metadata: object) -> None:
        """Exports are whole prompts copied after the request finished, not layer by layer."""

    def wait_for_save(self, metadata: PDConnectorMetadata | None) -> None:
        """Copy out the prompt KV this step completed and hand it to the transport (which
        does not wait on the store)."""
        if metadata is None:
            return
        for spec in metadata.saves:
            tid = spec.params.transfer_id
            try:
                kv = gather_kv(self._kv_caches, spec.block_ids, spec.params.num_tokens, self.block_size,
                               self._layer_groups)
                self.transport.publish(tid, kv, spec.params.num_tokens)
                self.stats["exports"] += 1
                self.stats["bytes_out"] += kv.numel() * kv.element_size()
            except Exception as e:  # the consumer's lookup reports it; it fails or recomputes
                logger.warning("KV export for %s failed: %s", spec.request_id, e)
                self.stats["export_failures"] += 1
                self.transport.abandon(tid, f"KV export failed: {e}")

    def get_finished(self) -> KVConnectorOutput:
        finished, self._finished = self._finished, KVConnectorOutput()
        return finished

    def transfer_stats(self) -> dict[str, int | float]:
        return dict(self.stats)

    def pending_exports(self) -> int:
        return self.transport.outbox_size

    def num_pending_loads(self) -> int:
        with self._lock:
            return len(self._loads)
