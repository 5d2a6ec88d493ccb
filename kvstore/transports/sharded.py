"""Rank r's view of a transport under tensor-parallel P/D (see kvstore.shards, kvstore.reshard)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.kv_transfer_params import KVTransferParams
from kvstore.shards import shard_transfer_id
from kvstore.transports.base import KVTransport


class ShardTransport(KVTransport):
    """Rank `rank`'s view of a transport. As a producer it exports shard `rank` of each
    transfer the connector names. As a consumer the connector names the producer shards it
    reads itself (kvstore.reshard: they depend on both roles' sizes), so fetches and releases
    go to `inner` unchanged, as do the store's calls back into the rank (take_export,
    drop_export), which already carry shard ids."""

    def __init__(self, inner: KVTransport, rank: int) -> None:
        self.inner = inner
        self.rank = rank
        self.name = inner.name

    def publish(self, transfer_id: str, kv: torch.Tensor, num_tokens: int) -> None:
        self.inner.publish(shard_transfer_id(transfer_id, self.rank), kv, num_tokens)

    def abandon(self, transfer_id: str, reason: str) -> None:
        self.inner.abandon(shard_transfer_id(transfer_id, self.rank), reason)

    def fetch_async(self, params: KVTransferParams, on_done: Callable[[object], None], readers: int = 1) -> None:
        self.inner.fetch_async(params, on_done, readers)

    def release(self, params: KVTransferParams) -> None:
        self.inner.release(params)

    def warm_up(self, producer: bool) -> None:
        self.inner.warm_up(producer)

    def take_export(self, transfer_id: str):
        return self.inner.take_export(transfer_id)

    def drop_export(self, transfer_id: str) -> None:
        self.inner.drop_export(transfer_id)

    @property
    def outbox_size(self) -> int:
        return self.inner.outbox_size
