"""The data-parallel cores' own process group: one small gloo group between the engine cores
(not their workers, whose world the model's collectives use), for the all-reduce that decides
whether a wave goes on. Built without torch.distributed's global state, so a core whose worker
lives in the same process can still join its own world."""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist


def _store(init_method: str, rank: int, size: int, timeout: timedelta) -> dist.Store:
    """file:///path (cores on one node) or tcp://host:port (core 0 hosts the store)."""
    url = urlparse(init_method)
    if url.scheme == "file":
        return dist.FileStore(url.path, size)
    if url.scheme == "tcp":
        return dist.TCPStore(url.hostname, url.port, size, is_master=rank == 0, timeout=timeout)
    raise ValueError(f"data-parallel control group: unsupported rendezvous {init_method!r}")


class DPControlGroup:
    def __init__(self, rank: int, size: int, init_method: str, timeout: timedelta) -> None:
        self.rank = rank
        self.size = size
        store = dist.PrefixStore("pdserve-dp-control", _store(init_method, rank, size, timeout))
        self._group = dist.ProcessGroupGloo(store, rank, size, timeout)

    def any(self, flag: bool) -> bool:
        """Whether `flag` holds on any core (every core calls this at the same step)."""
        value = torch.tensor([int(flag)], dtype=torch.int32)
        self._group.allreduce([value]).wait()
        return bool(value.item())
