"""The transport interface, and an in-process transport for engines sharing one process."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from engine.kv_transfer_params import KVTransferParams
from kvstore.handoff import ExportFailed, Handbacks, Inbox
from kvstore.kv_io import MalformedKV
from kvstore.shards import base_transfer_id

logger = logging.getLogger(__name__)
_WARMUP_TIMEOUT_S = 30.0
# How long a consumer waits for a registration the producer sent before its result: it
# normally arrives within milliseconds of the prefill's output.
_REGISTRATION_WAIT_S = 10.0


class TransferError(RuntimeError):
    """The KV of a transfer could not be fetched (expired, released, producer gone, ...)."""


class KVTransport(ABC):
    """Producer side: `publish` and `abandon`; consumer side: `fetch_async` and `release`.

    None of them may block the engine thread on a remote call: `publish` hands the bytes
    over and registers them without waiting for the store's answer (a refusal reaches the
    consumer through its lookup); `fetch_async` calls `on_done(tensor or exception)` from any
    thread; `release` is fire-and-forget. `readers` (passed only when above 1): how many ranks
    of a tensor-parallel consumer fetch the same transfer (kvstore.reshard), for a transport
    whose producer hands an export out once per fetch.
    """

    name = "base"
    # Whether a producer's export can go back in the prefill's reply (kvstore.handoff).
    hands_off = False

    @abstractmethod
    def publish(self, transfer_id: str, kv: torch.Tensor, num_tokens: int) -> None: ...

    @abstractmethod
    def abandon(self, transfer_id: str, reason: str) -> None:
        """The producer could not export `transfer_id`: tell whoever will look it up why."""

    @abstractmethod
    def fetch_async(self, params: KVTransferParams, on_done: Callable[[object], None], readers: int = 1) -> None: ...

    @abstractmethod
    def release(self, params: KVTransferParams) -> None: ...

    def warm_up(self, producer: bool) -> None:
        """Make the first transfer as fast as the next (connections, handle set-up)."""
        del producer  # an in-process transport has nothing to set up


class LocalTransport(KVTransport):
    """Both sides in one process (tests, single-process P/D): a locked dict of tensors."""

    name = "local"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, torch.Tensor] = {}
        self._abandoned: dict[str, str] = {}

    def publish(self, transfer_id: str, kv: torch.Tensor, num_tokens: int) -> None:
        with self._lock:
            self._data[transfer_id] = kv

    def abandon(self, transfer_id: str, reason: str) -> None:
        with self._lock:
            self._abandoned[transfer_id] = reason

    def fetch_async(self, params: KVTransferParams, on_done: Callable[[object], None], readers: int = 1) -> None:
        tid = params.transfer_id
        with self._lock:
            kv = self._data.get(tid)
            reason = self._abandoned.pop(tid, None)
        on_done(kv if kv is not None else TransferError(reason or f"transfer {tid!r} not found"))

    def release(self, params: KVTransferParams) -> None:
        """Drops the transfer and its shards, as the store does (kvstore.directory)."""
        with self._lock:
            for tid in [t for t in self._data if base_transfer_id(t) == params.transfer_id]:
                del self._data[tid]

    @property
    def live_transfers(self) -> int:
        with self._lock:
            return len(self._data)


class StoreBackedTransport(KVTransport):
    """A transport whose transfers are registered in the KV store actor: producers hold
    exports in an outbox until they are taken or dropped; consumers look transfers up in the
    store and receive on a thread of their own (`_receive`).

    Handoff (kvstore.handoff): an export the producer was told to expect back in a reply
    (`handbacks`) skips the store, and so does a consumer's fetch of one delivered to its
    `inbox`, and its release."""

    def __init__(self, store, replica_id: str, timeout_s: float) -> None:
        self.store = store
        self.replica_id = replica_id
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._outbox: dict[str, torch.Tensor] = {}
        self.handbacks = Handbacks()
        self.inbox = Inbox()

    # producer ------------------------------------------------------------------------------
    def _hold(self, transfer_id: str, kv: torch.Tensor) -> None:
        with self._lock:
            self._outbox[transfer_id] = kv

    def take_export(self, transfer_id: str) -> torch.Tensor | None:
        with self._lock:
            return self._outbox.pop(transfer_id, None)

    def drop_export(self, transfer_id: str) -> None:
        self.take_export(transfer_id)

    @property
    def outbox_size(self) -> int:
        with self._lock:
            return len(self._outbox)

    # consumer ------------------------------------------------------------------------------
    def abandon(self, transfer_id: str, reason: str) -> None:
        self.drop_export(transfer_id)
        if not self.handbacks.offer(transfer_id, ExportFailed(reason)):
            self.store.abandon.remote(transfer_id, reason)

    def fetch_async(self, params: KVTransferParams, on_done: Callable[[object], None], readers: int = 1) -> None:
        handed = self.inbox.claim(params.transfer_id)
        if isinstance(handed, ExportFailed):
            on_done(TransferError(handed.reason))
            return
        if handed is not None:  # its bytes, or their refusal (kvstore.handoff)
            on_done(handed)
            return
        threading.Thread(target=self._fetch, args=(params, on_done, readers), daemon=True,
                         name=f"kv-fetch-{params.transfer_id}").start()

    def _fetch(self, params: KVTransferParams, on_done, readers: int) -> None:
        import ray

        tid = params.transfer_id
        try:
            # The producer does not wait for its registration: it may still be on its way.
            wait_s = min(self.timeout_s, _REGISTRATION_WAIT_S)
            entry = ray.get(self.store.lookup.remote(tid, wait_s), timeout=self.timeout_s + wait_s)
            if entry is None:
                raise TransferError(f"transfer {tid!r} is unknown (expired or released)")
            if "error" in entry:
                raise TransferError(entry["error"])
            on_done(self._receive(params, entry, readers))
        except Exception as e:  # a refusal keeps its reason (the connector counts it)
            on_done(e if isinstance(e, (TransferError, MalformedKV)) else TransferError(f"{type(e).__name__}: {e}"))

    @abstractmethod
    def _receive(self, params: KVTransferParams, entry: dict, readers: int) -> torch.Tensor:
        """Get the bytes of a transfer the store knows (runs on the fetch thread); raise
        MalformedKV if they do not match the meta registered with them. `readers`: see
        KVTransport."""

    def release(self, params: KVTransferParams) -> None:
        if not self.inbox.forget(params.transfer_id):
            self.store.release.remote(params.transfer_id)

    def warm_up(self, producer: bool) -> None:
        """The first Ray call carrying this actor's handle to the store costs ~1 s (measured):
        pay it at start-up with a dummy transfer, not on a user's first request. (Pair groups
        of torch_dist are still made on first use with each peer.)"""
        import ray

        tid = f"warmup-{self.replica_id}"
        try:
            if producer:
                self.publish(tid, torch.zeros(1), 0)
                ray.get(self.store.lookup.remote(tid, _WARMUP_TIMEOUT_S), timeout=2 * _WARMUP_TIMEOUT_S)
                # Nobody fetches it: out of the outbox now, not when the release below has
                # made its way back here (outbox figures are exact from the start).
                self.drop_export(tid)
                # Not waited for: releasing may call back into this actor (drop_export),
                # which cannot run while it is still being constructed.
                self.store.release.remote(tid)
            else:
                ray.get(self.store.lookup.remote(tid), timeout=_WARMUP_TIMEOUT_S)
        except Exception as e:  # a slow store must not keep the replica from starting
            logger.warning("KV transport warm-up failed (first transfer will be slower): %s", e)
