"""KV transfer through the Ray object store (the default transport)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import ray
import torch

from kvstore.transports.base import StoreBackedTransport, TransferError


class ObjectStoreTransport(StoreBackedTransport):
    """Producer: keeps the export in an outbox until the store pulls it with
    `take_export` (so the store owns the object). Consumer: looks the transfer up in the store
    and reads the object directly; then releases it."""

    name = "object_store"

    def __init__(self, store, replica_id: str, self_handle_fn: Callable[[], object],
                 fetch_timeout_s: float = 60.0) -> None:
        self.store = store
        self.replica_id = replica_id
        self._self_handle_fn = self_handle_fn  # the hosting actor's handle (for the store to call)
        self.fetch_timeout_s = fetch_timeout_s
        self._outbox: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    # producer ------------------------------------------------------------------------------
    def publish(self, transfer_id: str, kv: torch.Tensor, num_tokens: int) -> dict:
        kv = kv.cpu()  # the object store is host memory
        with self._lock:
            self._outbox[transfer_id] = kv
        nbytes = kv.numel() * kv.element_size()
        reply = ray.get(self.store.register.remote(transfer_id, self.replica_id, self._self_handle_fn(),
                                                   nbytes, num_tokens))
        if not reply["ok"]:
            self.take_export(transfer_id)  # drop it: nobody will pull it
            raise TransferError(reply["error"])
        return {"nbytes": nbytes}

    def take_export(self, transfer_id: str) -> torch.Tensor | None:
        with self._lock:
            return self._outbox.pop(transfer_id, None)

    @property
    def outbox_size(self) -> int:
        with self._lock:
            return len(self._outbox)

    # consumer ------------------------------------------------------------------------------
    def fetch_async(self, params: dict, on_done: Callable[[object], None]) -> None:
        threading.Thread(target=self._fetch, args=(params, on_done), daemon=True,
                         name=f"kv-fetch-{params['transfer_id']}").start()

    def _fetch(self, params: dict, on_done) -> None:
        try:
            entry = ray.get(self.store.lookup.remote(params["transfer_id"]), timeout=self.fetch_timeout_s)
            if entry is None:
                raise TransferError(f"transfer {params['transfer_id']!r} is unknown (expired or released)")
            kv = ray.get(entry["refs"][0], timeout=self.fetch_timeout_s)
            if kv is None:
                raise TransferError(f"transfer {params['transfer_id']!r} had no data at its producer")
            on_done(kv)
        except Exception as e:
            on_done(e if isinstance(e, TransferError) else TransferError(f"{type(e).__name__}: {e}"))

