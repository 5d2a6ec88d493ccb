"""The P/D KV connector: the engine's hooks (engine.kv_connector) implemented over a transport.

Producer: a request submitted with `kv_transfer_params={"do_remote_decode": True}` exports the
KV of its prompt when it finishes; its blocks stay allocated until the export is copied out,
and its output carries the kv_transfer_params a decoder needs.

Consumer: a request submitted with those params has its prompt reported as externally
computed; it waits in WAITING_FOR_REMOTE_KVS while the transport fetches the bytes (off the
engine thread), they are written into its freshly allocated blocks between steps, and only
then is it scheduled. A failed fetch is either an error for that request ("fail") or a local
recompute of the prompt ("recompute"); a request never runs on partial KV.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass

from engine.kv_connector import KVConnectorBase
from engine.request import Request, RequestStatus
from kvstore.kv_io import gather_kv, scatter_kv
from kvstore.transports.base import KVTransport

logger = logging.getLogger(__name__)

ROLES = ("producer", "consumer", "both")
POLICIES = ("fail", "recompute")


@dataclass
class _Load:
    params: dict
    block_ids: list[int]
    start: int
    end: int
    started: float
    result: object = None  # tensor, exception, or None while in flight


class PDConnector(KVConnectorBase):
    def __init__(self, role: str, transport: KVTransport, replica_id: str, block_size: int,
                 load_failure_policy: str = "fail") -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if load_failure_policy not in POLICIES:
            raise ValueError(f"load_failure_policy must be one of {POLICIES}, got {load_failure_policy!r}")
        self.role = role
        self.transport = transport
        self.replica_id = replica_id
        self.block_size = block_size
        self.load_failure_policy = load_failure_policy
        self._lock = threading.Lock()
        self._local_hits: dict[str, int] = {}
        self._loads: dict[str, _Load] = {}
        self._exports: dict[str, tuple[list[int], int, dict]] = {}
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: dict[str, str] = {}
        self.export_errors: dict[str, str] = {}
        self.stats = {"exports": 0, "loads": 0, "load_failures": 0, "bytes_out": 0, "bytes_in": 0,
                      "load_seconds": 0.0}

    # ---- scheduler side -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if self.role == "producer" or not params or "transfer_id" not in params:
            return 0, False
        n = int(params["num_tokens"]) - num_computed_tokens
        if n <= 0:  # the local prefix cache already covers the transfer
            self.transport.release(params)
            request.kv_transfer_params = None
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        return n, True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        start = self._local_hits.pop(request.request_id)
        load = _Load(dict(request.kv_transfer_params), list(block_ids), start, start + num_external_tokens,
                     time.monotonic())
        with self._lock:
            self._loads[request.request_id] = load

        def on_done(result, rid=request.request_id):
            with self._lock:
                if rid in self._loads:
                    self._loads[rid].result = result
            if self.on_load_done is not None:
                self.on_load_done()

        self.transport.fetch_async(load.params, on_done)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = request.request_id
        with self._lock:
            load = self._loads.pop(rid, None)
        if load is not None:  # finished (aborted) while its KV was still loading
            self.transport.release(load.params)
        params = request.kv_transfer_params or {}
        exporting = (
            self.role != "consumer" and params.get("do_remote_decode")
            and request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        )
        if not exporting:
            return False, None
        transfer = {
            # The requester may name the transfer up front, so it can release it even if it
            # never receives the prefill's result.
            "transfer_id": params.get("transfer_id") or f"{self.replica_id}-{rid}-{uuid.uuid4().hex[:8]}",
            "num_tokens": request.num_prompt_tokens,
            "block_size": self.block_size,
            "source": self.replica_id,
            "transport": self.transport.name,
        }
        self._exports[rid] = (list(block_ids), request.num_prompt_tokens, transfer)
        return True, transfer

    # ---- worker side --------------------------------------------------------------------
    def start_load_kv(self, metadata, kv_caches) -> None:
        """Write every completed fetch into its blocks (between steps, on the engine thread)."""
        with self._lock:
            done = {rid: load for rid, load in self._loads.items() if load.result is not None}
            for rid in done:
                del self._loads[rid]
        for rid, load in done.items():
            result = load.result
            try:
                if isinstance(result, BaseException):
                    raise result
                scatter_kv(kv_caches, load.block_ids, load.start, load.end, self.block_size, result)
            except Exception as e:  # never run on partial or missing KV
                logger.warning("KV load for %s failed: %s", rid, e)
                self._failed_recving[rid] = f"KV load failed: {e}"
                self.stats["load_failures"] += 1
            else:
                self._finished_recving.add(rid)
                self.stats["loads"] += 1
                self.stats["bytes_in"] += result.numel() * result.element_size()
                self.stats["load_seconds"] += time.monotonic() - load.started
            self.transport.release(load.params)

    def wait_for_save(self) -> None:
        """Exports are copied out synchronously in `save_kv`; nothing is left in flight."""

    def save_kv(self, kv_caches) -> None:
        """Copy out the KV of producer requests that finished this step, then let their
        blocks go."""
        exports, self._exports = self._exports, {}
        for rid, (block_ids, num_tokens, transfer) in exports.items():
            try:
                kv = gather_kv(kv_caches, block_ids, num_tokens, self.block_size)
                transfer.update(self.transport.publish(transfer["transfer_id"], kv, num_tokens))
                transfer["dtype"] = str(kv.dtype).removeprefix("torch.")
                transfer["shape"] = list(kv.shape)
                self.stats["exports"] += 1
                self.stats["bytes_out"] += kv.numel() * kv.element_size()
            except Exception as e:
                logger.warning("KV export for %s failed: %s", rid, e)
                self.export_errors[rid] = str(e)
            self._finished_sending.add(rid)

    def get_finished(self) -> tuple[set[str], set[str], dict[str, str]]:
        """(exports done: free their blocks, loads done: schedule them, loads failed: reason)."""
        sending, self._finished_sending = self._finished_sending, set()
        recving, self._finished_recving = self._finished_recving, set()
        failed, self._failed_recving = self._failed_recving, {}
        return sending, recving, failed

    def num_pending_loads(self) -> int:
        with self._lock:
            return len(self._loads)
