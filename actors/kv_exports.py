"""The KV store's calls into an actor that holds a P/D producer's exports (a tensor-parallel
rank actor, or a data-parallel core actor whose one rank is in-process): the store pulls an
export from the actor that holds it, so the object it gets is the store's own. With the
torch_dist transport a consumer calls such an actor too, to pair with it and have it send."""

from __future__ import annotations


class ServesKVExports:
    """Mixed into an actor class, which overrides `_kv_worker()` to return the Worker whose
    connector holds its exports."""

    def _kv_worker(self):
        """The Worker holding this actor's exports; None: it holds none (nothing to take)."""
        return None

    def _connector(self):
        worker = self._kv_worker()
        return worker.kv_connector if worker is not None else None

    def _transport(self):
        connector = self._connector()
        return connector.transport if connector is not None else None

    def take_export(self, transfer_id: str):
        transport = self._transport()
        return transport.take_export(transfer_id) if transport is not None else None

    def drop_export(self, transfer_id: str) -> None:
        transport = self._transport()
        if transport is not None:
            transport.drop_export(transfer_id)

    # ---- the torch_dist transport's calls from a consumer (kvstore.transports.torch_dist) -----
    def _peer_transport(self):
        transport = self._transport()
        return getattr(transport, "inner", transport)  # a rank's ShardTransport wraps it

    def open_pair(self, consumer_id: str) -> None:
        self._peer_transport().open_pair(consumer_id)

    def send_kv(self, transfer_id: str, consumer_id: str, tag: int, readers: int = 1) -> None:
        self._peer_transport().send(transfer_id, consumer_id, tag, readers)
