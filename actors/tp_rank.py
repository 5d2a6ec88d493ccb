"""The body of one tensor-parallel rank as a Ray actor ("ray" executor): join the process
group, build the Worker, answer the executor's calls. With P/D it also answers the KV store
for its own shard of each export (`take_export`, `drop_export`): the store pulls every
rank's shard from the rank that holds it."""

from __future__ import annotations

import dataclasses
import pickle
import socket
from datetime import timedelta
from typing import Any

import ray
import torch

from actors.kv_exports import ServesKVExports
from engine.distributed import init_parallel_groups
from engine.executor.base import WorkerConfig, rank_reply
from engine.kv_connector import KVConnectorFactory
from engine.worker.worker import Worker
from kvstore.connector_factory import PDConnectorFactory


class TPRank(ServesKVExports):
    def __init__(self, config: WorkerConfig, rank: int, size: int,
                 kv_connector_factory: KVConnectorFactory | None) -> None:
        if config.device.type == "cuda":
            # Ray gave this actor one GPU and made it the only one it sees.
            config = dataclasses.replace(config, device=torch.device("cuda", 0))
        self.config = config
        self.rank = rank
        self.size = size
        if isinstance(kv_connector_factory, PDConnectorFactory):
            kv_connector_factory = kv_connector_factory.for_rank(rank)  # this rank's shard
        self.kv_connector_factory = kv_connector_factory
        self.worker: Worker | None = None

    def rendezvous_address(self) -> str:
        """Called on rank 0 only: a free TCP port on its node for the group's store."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        return f"tcp://{host}:{port}"

    def start(self, init_method: str, collective_timeout_s: float, num_threads: int) -> None:
        # Ranks share the node's cores; without this each would start one thread per core.
        torch.set_num_threads(num_threads)
        if self.config.device.type == "cuda":
            torch.cuda.set_device(0)
        tp, ep = init_parallel_groups(self.rank, self.size, self.config.dp,
                                      self.config.engine.parallel.enable_expert_parallel, init_method,
                                      self.config.device, timedelta(seconds=collective_timeout_s))
        self.worker = Worker(self.config, self.rank, self.kv_connector_factory, tp=tp, ep=ep)
        connector = self.worker.kv_connector
        if connector is not None:
            connector.transport.warm_up(producer=connector.pd_role == "producer")

    def call(self, method: str, payload: bytes) -> Any:
        """`payload` is (args, kwargs), pickled once by the executor for every rank."""
        args, kwargs = pickle.loads(payload)
        return rank_reply(self.rank == 0, method, getattr(self.worker, method)(*args, **kwargs))

    def ping(self) -> int:
        return self.rank

    # ---- the KV store's calls (P/D producer ranks): see ServesKVExports ------------------
    def _kv_worker(self):
        return self.worker

    def outbox_size(self) -> int:
        transport = self._transport()
        return transport.outbox_size if transport is not None else 0

    def kv_transfer_stats(self) -> dict:
        connector = self._connector()
        return dict(connector.stats) if connector is not None else {}

