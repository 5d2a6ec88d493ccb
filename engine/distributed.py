"""The tensor-parallel group one rank belongs to, and the three collectives the sharded model
needs (all-reduce, gather to rank 0, broadcast from rank 0) over torch.distributed.

A group of size 1 never touches torch.distributed: every collective is the identity, so a
single-rank engine runs exactly the code it ran before tensor parallelism existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and answers for the group."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_to_driver(self, x: torch.Tensor) -> torch.Tensor | None:
        """x: [N, V/tp] on every rank -> [N, V] on rank 0 (ranks in order along the last
        dim), None elsewhere."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_driver else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_from_driver(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (others pass a buffer of the same shape and dtype)."""
        if self.size > 1:
            dist.broadcast(x, src=0)
        return x


# The group of an engine that is not sharded.
SINGLE_RANK = TPGroup()


def init_tp_group(rank: int, size: int, init_method: str, device: torch.device,
                  timeout: timedelta) -> TPGroup:
    """Join the process group: NCCL between GPUs, gloo on CPU. `timeout` bounds every
    collective, so a rank stuck on a dead peer errors out instead of hanging."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    return TPGroup(rank, size)


def destroy_tp_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
