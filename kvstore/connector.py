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

Release: a transfer a consumer request names is released exactly once, by this connector's
worker side: after its load (done or failed), or when the request finishes without loading
(aborted first, or its prompt found in the local prefix cache).
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
from kvstore.transports.base import KVTransport, TransferError

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
    result: object = None  # tensor, exception, or None while in flight


class PDConnector(KVConnectorBase):
    """One side (`side`) of the P/D connector of a replica whose P/D role is `pd_role`."""

    def __init__(self, side: KVConnectorRole, pd_role: str, transport: KVTransport, replica_id: str,
                 block_size: int, load_failure_policy: str = DEFAULT_LOAD_FAILURE_POLICY,
                 tensor_parallel_size: int = 1) -> None:
        super().__init__(side)
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
        self.kv_load_failure_policy = load_failure_policy
        # scheduler side
        self._meta = PDConnectorMetadata()
        self._local_hits: dict[str, int] = {}
        # Producer requests whose prompt is being computed: (prompt length, block ids so far
        # per KV cache group, the request's own params).
        self._producing: dict[str, tuple[int, list[list[int]], KVTransferParams]] = {}
        self._exported: dict[str, KVTransferParams] = {}  # saved, for request_finished
        self._loading: set[str] = set()  # loads handed to the worker side, not reported yet
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
        self._loading.add(rid)

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
            self._loading.discard(rid)
            self._loaded.add(rid)

    def request_finished(self, request: Request, block_ids: GroupBlockIds) -> tuple[bool, KVTransferParams | None]:
        rid = request.request_id
        params = request.kv_transfer_params
        self._local_hits.pop(rid, None)
        if params is not None and params.loads_remote_kv:
            if rid in self._loaded:
                self._loaded.discard(rid)  # released by the worker side already
            else:
                # Loading, or never got blocks: the worker side drops the load and releases.
                self._loading.discard(rid)
                self._meta.abandoned.append((rid, params))
        self._producing.pop(rid, None)
        transfer = self._exported.pop(rid, None)
        if transfer is None or request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                                      RequestStatus.FINISHED_STOPPED):
            # Aborted or failed: whoever named the transfer releases what was saved, if any.
            return False, None
        # The export was copied out in the step that computed it: the blocks may go now.
        return False, transfer

    # ---- worker side --------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list, layer_groups: list[int] | None = None) -> None:
        self._kv_caches = kv_caches
        self._layer_groups = layer_groups

    def set_wakeup(self, callback: Callable[[], None]) -> None:
        self._wakeup = callback

    def start_load_kv(self, metadata: PDConnectorMetadata | None) -> None:
        """Drop abandoned loads, start new ones, and write every completed fetch into its
        blocks (between steps, on the engine thread)."""
        if metadata is not None:
            for rid, params in metadata.abandoned:
                with self._lock:
                    self._loads.pop(rid, None)
                self.transport.release(params)
            for params in metadata.releases:
                self.transport.release(params)
            for spec in metadata.loads:
                self._start_fetch(spec)
        with self._lock:
            done = {rid: load for rid, load in self._loads.items() if load.result is not None}
            for rid in done:
                del self._loads[rid]
        for rid, load in done.items():
            self._write(rid, load)

    def _start_fetch(self, spec: LoadSpec) -> None:
        load = _Load(spec, time.monotonic())
        with self._lock:
            self._loads[spec.request_id] = load
        if spec.params.tensor_parallel_size != self.tensor_parallel_size:
            # Each producer rank exported its own heads: the shards fit only as many ranks.
            load.result = TransferError(
                f"the prefill ran with tensor_parallel_size={spec.params.tensor_parallel_size} and this "
                f"decode replica with {self.tensor_parallel_size}; P/D needs the same size on both roles")
            return

        def on_done(result, rid=spec.request_id):
            with self._lock:
                if self._loads.get(rid) is load:
                    load.result = result
            if self._wakeup is not None:
                self._wakeup()

        self.transport.fetch_async(spec.params, on_done)

    def _write(self, rid: str, load: _Load) -> None:
        spec, result = load.spec, load.result
        try:
            if isinstance(result, BaseException):
                raise result
            # Checks the KV against the transfer's params and this cache before writing any of it.
            scatter_kv(self._kv_caches, spec.block_ids, spec.start, spec.end, self.block_size, result,
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
            self.stats["bytes_in"] += result.numel() * result.element_size()
            self.stats["load_seconds"] += time.monotonic() - load.started
        self.transport.release(spec.params)

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
