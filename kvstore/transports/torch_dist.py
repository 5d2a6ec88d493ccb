"""KV transfer over torch.distributed point-to-point (gloo on CPU, NCCL on GPUs).

There is no global process group: each (producer, consumer) pair gets its own two-rank group,
created lazily on first use through a TCPStore rendezvous hosted by the producer, so replicas
can come and go while the cluster scales. The producer keeps each export in its outbox (on
its device) and registers only its whereabouts in the KV store; the consumer posts a receive
and asks the producer (a Ray call) to send. Unsent exports are dropped when the store
releases or expires the transfer.

Under tensor parallel every rank is a peer of its own (its own rendezvous, named
"<replica>.rank<r>" in the entry's meta), so a consumer rank pairs with each producer rank it
reads from. An export several consumer ranks read (kvstore.reshard: a decode of more ranks than
its prefill) is sent once to each of them before it leaves the producer's outbox.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import socket
import threading
from collections.abc import Callable

import ray
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from engine.kv_transfer_params import KVTransferParams
from kvstore.transports.base import StoreBackedTransport, TransferError

logger = logging.getLogger(__name__)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def default_host() -> str:
    """Loopback on a single-node cluster; the node's address when peers may be elsewhere."""
    try:
        if ray.is_initialized() and len([n for n in ray.nodes() if n.get("Alive")]) > 1:
            return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (tests): loopback
        pass
    return "127.0.0.1"


class TorchDistTransport(StoreBackedTransport):
    name = "torch_dist"

    def __init__(self, store, replica_id: str, self_handle_fn: Callable[[], object], device_type: str = "cpu",
                 timeout_s: float = 60.0, host: str | None = None) -> None:
        super().__init__(store, replica_id, timeout_s)
        self._self_handle_fn = self_handle_fn
        self.backend = "nccl" if device_type == "cuda" else "gloo"
        self.device = torch.device("cuda" if device_type == "cuda" else "cpu")
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.host = host or default_host()
        self._rendezvous: TCPStore | None = None
        self._port: int | None = None
        self._pairs: dict[str, object] = {}  # peer replica id -> 2-rank process group
        # One creation at a time per peer: concurrent fetches from a new producer must share
        # one rendezvous, not race several rank-1 joiners into it.
        self._pair_locks: dict[str, threading.Lock] = {}
        self._tags = itertools.count(1)
        self._sends: dict[str, int] = {}  # exports sent to some, not all, of their readers

    # ---- pair groups --------------------------------------------------------------------
    def _ensure_rendezvous(self) -> tuple[str, int]:
        with self._lock:
            if self._rendezvous is None:
                self._port = _free_port(self.host)
                self._rendezvous = TCPStore(self.host, self._port, is_master=True, wait_for_workers=False,
                                            timeout=self.timeout)
            return self.host, self._port

    def _new_group(self, store, rank: int):
        if self.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self.timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
            return dist.ProcessGroupGloo(store, rank, 2, opts)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = self.timeout
        return dist.ProcessGroupNCCL(store, rank, 2, opts)

    def open_pair(self, consumer_id: str) -> None:
        """Producer side of a pair (rank 0); blocks until the consumer joins."""
        self._ensure_rendezvous()
        with self._lock:
            if consumer_id in self._pairs:
                return
        group = self._new_group(PrefixStore(f"{self.replica_id}->{consumer_id}", self._rendezvous), 0)
        with self._lock:
            self._pairs[consumer_id] = group

    def _pair_with(self, producer, producer_id: str, host: str, port: int):
        """Consumer side (rank 1); the producer joins concurrently through a Ray call."""
        with self._lock:
            creating = self._pair_locks.setdefault(producer_id, threading.Lock())
        with creating:
            with self._lock:
                group = self._pairs.get(producer_id)
            if group is not None:
                return group
            # A dead producer would otherwise only show up as a rendezvous timeout.
            ray.get(producer.ping.remote(), timeout=min(10.0, self.timeout.total_seconds()))
            joined = producer.open_pair.remote(self.replica_id)
            client = TCPStore(host, port, is_master=False, timeout=self.timeout)
            group = self._new_group(PrefixStore(f"{producer_id}->{self.replica_id}", client), 1)
            ray.get(joined, timeout=self.timeout.total_seconds())
            with self._lock:
                self._pairs[producer_id] = group
            return group

    # ---- producer -----------------------------------------------------------------------
    def publish(self, transfer_id: str, kv: torch.Tensor, num_tokens: int) -> None:
        host, port = self._ensure_rendezvous()
        kv = kv.to(self.device).contiguous()
        self._hold(transfer_id, kv)
        nbytes = kv.numel() * kv.element_size()
        # The consumer sizes its receive buffer from the entry's meta, so the bytes always
        # match its shape and dtype (kvstore.kv_io.check_kv then holds them to the cache). No
        # crc32: on NCCL the bytes never leave device memory, where it would cost a copy out.
        meta = {"host": host, "port": port, "shape": list(kv.shape), "dtype": str(kv.dtype).removeprefix("torch."),
                "peer": self.replica_id}
        self.store.register.remote(transfer_id, self.replica_id, self._self_handle_fn(), nbytes, num_tokens,
                                   meta=meta, pull=False)

    def send(self, transfer_id: str, consumer_id: str, tag: int, readers: int = 1) -> None:
        """Send an export to one of its `readers`; the last send takes it out of the outbox."""
        with self._lock:
            kv = self._outbox.get(transfer_id)
            sent = self._sends.pop(transfer_id, 0) + 1
            if sent >= readers:
                self._outbox.pop(transfer_id, None)
            elif kv is not None:
                self._sends[transfer_id] = sent
            group = self._pairs.get(consumer_id)
        if kv is None:
            raise TransferError(f"transfer {transfer_id!r} is not (or no longer) held by {self.replica_id}")
        if group is None:
            raise TransferError(f"no process group with {consumer_id}")
        group.send([kv], 1, tag).wait(self.timeout)

    def drop_export(self, transfer_id: str) -> None:
        with self._lock:
            self._sends.pop(transfer_id, None)
        super().drop_export(transfer_id)

    # ---- consumer -----------------------------------------------------------------------
    def _receive(self, params: KVTransferParams, entry: dict, readers: int) -> torch.Tensor:
        tid = params.transfer_id
        producer = entry["producer"]
        meta = entry["meta"]
        peer = meta["peer"]  # the producer, or its tensor-parallel rank
        group = self._pair_with(producer, peer, meta["host"], meta["port"])
        buf = torch.empty(meta["shape"], dtype=getattr(torch, meta["dtype"]), device=self.device)
        tag = next(self._tags)
        work = group.recv([buf], 0, tag)
        try:
            ray.get(producer.send_kv.remote(tid, self.replica_id, tag, readers), timeout=self.timeout.total_seconds())
        except Exception:
            with self._lock:  # the pair is unusable with a receive left pending
                self._pairs.pop(peer, None)
            raise
        work.wait(self.timeout)
        return buf
