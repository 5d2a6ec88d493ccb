"""A test double of tensor parallelism: every rank a thread of the test process, collectives
through a barrier. It runs the real sharded model, loader and engine path (only the transport
of the three collectives differs), so each model family's shard math is checked without
paying for a process per rank; the gloo executors are tested on one family."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.distributed import TPGroup
from engine.executor.base import Executor, WorkerConfig, merge_step_replies, rank_reply
from engine.executor.kv_aggregate import KVOutputAggregator
from engine.sched_output import ModelRunnerOutput, SchedulerOutput
from engine.worker.worker import Worker


class Exchange:
    """Every rank puts one tensor in and gets all of them back, in rank order."""

    def __init__(self, size: int) -> None:
        self.slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)

    def all(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x.clone()
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return values


@dataclass(frozen=True)
class ThreadGroup(TPGroup):
    exchange: Exchange = field(default=None, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        total = torch.zeros_like(x)
        for part in self.exchange.all(self.rank, x):  # rank order: the same sum on every rank
            total += part
        return x.copy_(total)

    def gather_to_driver(self, x: torch.Tensor) -> torch.Tensor | None:
        parts = self.exchange.all(self.rank, x.contiguous())
        return torch.cat(parts, dim=-1) if self.is_driver else None

    def broadcast_from_driver(self, x: torch.Tensor) -> torch.Tensor:
        return x.copy_(self.exchange.all(self.rank, x)[0])


class ThreadExecutor(Executor):
    def __init__(self, config: WorkerConfig, kv_connector_factory=None) -> None:
        super().__init__(config)
        size = config.engine.parallel.tensor_parallel_size
        exchange = Exchange(size)
        self.pool = ThreadPoolExecutor(size)
        self.kv_outputs = KVOutputAggregator(size)
        self.workers = list(self.pool.map(
            lambda r: Worker(config, r, tp=ThreadGroup(r, size, exchange)), range(size)))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        replies = self.collective_rpc("execute_model", (scheduler_output,))
        return merge_step_replies(replies, self.kv_outputs, scheduler_output)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        def call(worker: Worker):
            return rank_reply(worker.tp.is_driver, method, getattr(worker, method)(*args, **(kwargs or {})))

        return list(self.pool.map(call, self.workers))

    def set_kv_wakeup(self, callback) -> None:
        """No connector in these tests."""

    def shutdown(self) -> None:
        self.pool.shutdown()
