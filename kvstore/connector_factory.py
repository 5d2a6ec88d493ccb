"""A KV-connector factory that can travel to another process (a tensor-parallel rank actor, or
a data-parallel core actor, which builds both sides).

With one rank and one core the EngineHost builds its connector sides in its own process;
otherwise they are built in other actors, which therefore need the recipe rather than a
closure over the replica's objects. Rank r moves shard r of every transfer
(kvstore.shards), so the factory is specialised per rank (`for_rank`) before it is used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import ray
import torch

from engine.kv_connector import KVConnectorRole
from kvstore.connector import PDConnector
from kvstore.transports.object_store import ObjectStoreTransport
from kvstore.transports.sharded import ShardTransport
from kvstore.transports.torch_dist import TorchDistTransport


def _current_actor():
    """The actor this code runs in (the KV store pulls a rank's exports from it)."""
    return ray.get_runtime_context().current_actor


@dataclass(frozen=True)
class PDConnectorFactory:
    pd_role: str  # "producer" or "consumer"
    store: Any  # the KV store actor's handle
    replica_id: str
    block_size: int
    load_failure_policy: str
    tensor_parallel_size: int
    transport_timeout_s: float = 60.0
    # Whether the store pulls exports from the actor holding them (plain actors) or the
    # producer puts them itself (a Serve replica's ranks: see ObjectStoreTransport).
    store_pulls: bool = True
    rank: int | None = None  # set by for_rank: the worker side of that rank
    # The model's KV heads, all ranks' (a consumer rank re-shards by head, kvstore.reshard).
    num_kv_heads: int | None = None
    transport: str = "object_store"  # or "torch_dist" (plain actors: store_pulls)

    def for_rank(self, rank: int) -> PDConnectorFactory:
        return dataclasses.replace(self, rank=rank)

    def __call__(self, side: KVConnectorRole) -> PDConnector:
        if side is KVConnectorRole.WORKER and self.rank is None and self.tensor_parallel_size > 1:
            raise RuntimeError("the worker side of a tensor-parallel connector is built per rank (for_rank)")
        name = self.replica_id if self.rank is None else f"{self.replica_id}.rank{self.rank}"
        if self.transport == "torch_dist":
            device = "cuda" if torch.cuda.is_available() else "cpu"
            transport = TorchDistTransport(self.store, name, _current_actor, device_type=device,
                                           timeout_s=self.transport_timeout_s)
        else:
            transport = ObjectStoreTransport(self.store, name, _current_actor if self.store_pulls else None,
                                             fetch_timeout_s=self.transport_timeout_s)
        if self.rank is not None:
            transport = ShardTransport(transport, self.rank)
        return PDConnector(side, self.pd_role, transport, self.replica_id, self.block_size,
                           self.load_failure_policy, self.tensor_parallel_size, rank=self.rank or 0,
                           num_kv_heads=self.num_kv_heads)
