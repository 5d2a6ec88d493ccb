"""KV transfer through the Ray object store (the default transport)."""

from __future__ import annotations

import ray
import torch

from engine.kv_transfer_params import KVTransferParams
from kvstore.handoff import max_reply_kv_bytes
from kvstore.kv_io import check_bytes, kv_crc32
from kvstore.transports.base import StoreBackedTransport, TransferError


class ObjectStoreTransport(StoreBackedTransport):
    """Producer: keeps the export in its outbox until the store pulls it with
    `take_export` (so the store owns the object and it survives a dead producer). Consumer:
    reads the object the store points to, directly from the object store.

    Without a handle to its own actor (`self_handle_fn=None`: a Serve replica, whose actor
    only answers Serve's own calls) the producer puts the object itself and hands the store
    a reference; the producer then owns it, so a producer that dies before the decode side
    fetched loses the transfer (the load-failure policy decides what happens then)."""

    name = "object_store"
    hands_off = True  # kvstore.handoff

    def __init__(self, store, replica_id: str, self_handle_fn, fetch_timeout_s: float = 60.0) -> None:
        super().__init__(store, replica_id, fetch_timeout_s)
        self.max_reply_bytes = max_reply_kv_bytes()
        self._self_handle_fn = self_handle_fn  # the hosting actor's handle (for the store to call)

    def publish(self, transfer_id: str, kv: torch.Tensor, num_tokens: int) -> None:
        kv = kv.cpu()  # the object store (or a reply) is host memory
        nbytes = kv.numel() * kv.element_size()
        # Back in the prefill's reply (kvstore.handoff) when expected there and small enough
        # for both ends' gRPC limits; else (declined or not expected) the store carries it.
        if self.handbacks.offer(transfer_id, kv, nbytes, limit=self.max_reply_bytes):
            return
        # The consumer checks the bytes it gets against these (kvstore.kv_io.check_bytes).
        meta = {"crc32": kv_crc32(kv)}
        if self._self_handle_fn is None:
            # Wrapped in a list so Ray passes the reference; the store borrows it. The pending
            # call holds the reference until the store has it.
            self.store.register.remote(transfer_id, self.replica_id, None, nbytes, num_tokens,
                                       meta=meta, refs=[ray.put(kv)])
        else:
            self._hold(transfer_id, kv)
            self.store.register.remote(transfer_id, self.replica_id, self._self_handle_fn(), nbytes, num_tokens,
                                       meta=meta)

    def _receive(self, params: KVTransferParams, entry: dict, readers: int) -> torch.Tensor:
        # The store's object may be read any number of times: `readers` changes nothing.
        kv = ray.get(entry["refs"][0], timeout=self.timeout_s)
        if kv is None:
            raise TransferError(f"transfer {params.transfer_id!r} had no data at its producer")
        if not isinstance(kv, torch.Tensor):
            raise TransferError(f"transfer {params.transfer_id!r} holds a {type(kv).__name__}, not KV")
        check_bytes(kv, entry.get("nbytes"), entry.get("meta", {}).get("crc32"), "the object store")
        return kv
