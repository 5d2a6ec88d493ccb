"""The tensor-parallel group one rank belongs to, and the three collectives the sharded model
needs (all-reduce, gather to rank 0, broadcast from rank 0) over torch.distributed; and the
expert-parallel group, whose two collectives move each rank's tokens to every expert and the
experts' outputs back (all-gather of tokens, then a reduce-scatter that returns each rank its
own rows).

Worlds: without expert parallelism a worker's world is its engine core's tensor-parallel
group. With it and several data-parallel cores, one world spans every core's ranks (rank =
dp_rank * tp + tp_rank): the expert exchange runs over the whole world and each core's
tensor-parallel collectives in a subgroup of its own.

A group of size 1 never touches torch.distributed: every collective is the identity, so a
single-rank engine runs exactly the code it ran before tensor parallelism existed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

# Every collective of a worker's world is bounded by this: a rank whose peer died errors out
# (the executor then fails the engine) instead of waiting forever.
COLLECTIVE_TIMEOUT = timedelta(seconds=300)


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object | None = field(default=None, compare=False)  # a ProcessGroup; None = the world

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and answers for the group."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_to_driver(self, x: torch.Tensor) -> torch.Tensor | None:
        """x: [N, V/tp] on every rank -> [N, V] on rank 0 (ranks in order along the last
        dim), None elsewhere."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_driver else None
        dist.gather(x, parts, group=self.group, group_dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_from_driver(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (others pass a buffer of the same shape and dtype)."""
        if self.size > 1:
            dist.broadcast(x, group=self.group, group_src=0)
        return x


# The group of an engine that is not sharded.
SINGLE_RANK = TPGroup()


@dataclass(frozen=True)
class EPGroup:
    """The ranks that share the experts of every MoE layer (data parallel x tensor parallel
    ranks under `enable_expert_parallel`). Ranks hold different tokens, possibly none (an idle
    data-parallel rank in a dummy step still joins both collectives)."""

    rank: int = 0
    size: int = 1
    group: object | None = field(default=None, compare=False)  # a ProcessGroup; None = the world

    def gather_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """x: [T_r, ...] on rank r -> ([sum T, ...] in rank order on every rank, [T_0, ...])."""
        if self.size == 1:
            return x, [x.shape[0]]
        count = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
        counts = [torch.empty_like(count) for _ in range(self.size)]
        dist.all_gather(counts, count, group=self.group)
        sizes = [int(c.item()) for c in counts]
        # all_gather needs equal shapes: pad every rank's rows to the longest.
        padded = x.new_zeros((max(sizes), *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)]), sizes

    def combine(self, y: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """y: [sum T, ...], each rank's partial sums over its own experts for every gathered
        row -> this rank's rows [T_r, ...] summed over all ranks. A reduce-scatter: each rank
        receives only its own rows' sums (half an all-reduce's traffic)."""
        if self.size == 1:
            return y
        # reduce_scatter needs equal blocks: rank r's rows go to block r, padded to the longest.
        longest = max(sizes)
        blocks = y.new_zeros((self.size * longest, *y.shape[1:]))
        start = 0
        for r, n in enumerate(sizes):
            blocks[r * longest : r * longest + n] = y[start : start + n]
            start += n
        mine = y.new_empty((longest, *y.shape[1:]))
        _reduce_scatter(mine, blocks, group=self.group)
        return mine[: sizes[self.rank]]


# torch 2.13 renamed reduce_scatter_tensor (which now warns); older releases have only that.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# The group of an engine without expert parallelism.
SINGLE_EP = EPGroup()


@dataclass(frozen=True)
class DPPlacement:
    """Where one data-parallel engine core sits: core `rank` of `size`. `world_init_method`
    is the rendezvous of the world that spans every core's workers, set when expert
    parallelism joins them (None otherwise: each core's ranks form a world of their own)."""

    rank: int = 0
    size: int = 1
    world_init_method: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"data-parallel rank {self.rank} of {self.size}")


# The placement of an engine that is not data parallel.
SINGLE_DP = DPPlacement()


def init_tp_group(rank: int, size: int, init_method: str, device: torch.device,
                  timeout: timedelta) -> TPGroup:
    """Join the process group: NCCL between GPUs, gloo on CPU. `timeout` bounds every
    collective, so a rank stuck on a dead peer errors out instead of hanging."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    return TPGroup(rank, size)


def init_parallel_groups(tp_rank: int, tp_size: int, dp: DPPlacement, expert_parallel: bool,
                         init_method: str | None, device: torch.device,
                         timeout: timedelta) -> tuple[TPGroup, EPGroup]:
    """Join this worker's world and return its (tensor-parallel, expert-parallel) groups.
    `init_method` is the engine core's own rendezvous (its tensor-parallel world); a world
    across data-parallel cores uses `dp.world_init_method`. A world of one joins nothing."""
    across_cores = expert_parallel and dp.size > 1
    world = tp_size * dp.size if across_cores else tp_size
    if world == 1:
        return SINGLE_RANK, SINGLE_EP
    if across_cores and dp.world_init_method is None:
        raise ValueError("expert parallelism over data-parallel cores needs their world's rendezvous")
    rank = dp.rank * tp_size + tp_rank if across_cores else tp_rank
    init_tp_group(rank, world, dp.world_init_method if across_cores else init_method, device, timeout)
    ep = EPGroup(rank, world) if expert_parallel else SINGLE_EP
    if not across_cores:
        return TPGroup(tp_rank, tp_size), ep
    tp_group = None
    if tp_size > 1:
        # Every process creates every core's subgroup, in the same order (torch.distributed's rule).
        for core in range(dp.size):
            group = dist.new_group(list(range(core * tp_size, (core + 1) * tp_size)), timeout=timeout)
            if core == dp.rank:
                tp_group = group
    return TPGroup(tp_rank, tp_size, group=tp_group), ep


def destroy_tp_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
