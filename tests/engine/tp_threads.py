"""A test double of tensor parallelism: every rank a thread of the test process, collectives
through a barrier. It runs the real sharded model, loader and engine path (only the transport
of the three collectives differs), so each model family's shard math is checked without
paying for a process per rank; the gloo executors are tested on one family.

Expert parallelism the same way: a data-parallel group is several engines in threads (`DPRank`),
whose dp x tp ranks exchange tokens and expert outputs through one shared `Exchange`."""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.distributed import SINGLE_EP, EPGroup, TPGroup
from engine.executor.base import Executor, WorkerConfig, merge_step_replies, rank_reply
from engine.executor.kv_aggregate import KVOutputAggregator
from engine.models.attention_metadata import AttentionMetadata
from engine.request import Request
from engine.sched.output import ModelRunnerOutput, SchedulerOutput
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


@dataclass(frozen=True)
class ThreadEPGroup(EPGroup):
    exchange: Exchange = field(default=None, compare=False)

    def gather_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        parts = self.exchange.all(self.rank, x)
        return torch.cat(parts), [p.shape[0] for p in parts]

    def combine(self, y: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        total = torch.zeros_like(y)
        for part in self.exchange.all(self.rank, y):  # rank order, like all_reduce above
            total += part
        start = sum(sizes[: self.rank])
        return total[start : start + sizes[self.rank]]


@dataclass(frozen=True)
class DPRank:
    """An engine's place in a data-parallel group of engines in threads: its tp ranks are
    expert-parallel ranks rank * tp ... rank * tp + tp - 1 of size * tp, exchanging through
    `exchange` (one for the whole group, sized size * tp)."""

    rank: int
    size: int
    exchange: Exchange

    def ep_group(self, tp_rank: int, tp_size: int) -> ThreadEPGroup:
        return ThreadEPGroup(self.rank * tp_size + tp_rank, self.size * tp_size, exchange=self.exchange)


def run_on_no_tokens(worker: Worker) -> torch.Tensor:
    """An idle data-parallel rank's dummy step: the model on zero tokens, so that the busy
    ranks' expert-parallel collectives find this rank there. Returns the [0, H] hidden."""
    runner = worker.runner
    empty = torch.empty(0, dtype=torch.int64, device=runner.device)
    meta = AttentionMetadata(
        slot_mapping=empty, block_table=torch.zeros((0, 1), dtype=torch.int32, device=runner.device),
        query_start_loc=torch.zeros(1, dtype=torch.int32, device=runner.device),
        seq_lens=torch.zeros(0, dtype=torch.int32, device=runner.device), max_query_len=0, max_seq_len=0)
    with torch.inference_mode():
        return runner.model(empty, empty, runner.kv_caches, meta)


class ThreadExecutor(Executor):
    def __init__(self, config: WorkerConfig, kv_connector_factory=None, dp: DPRank | None = None) -> None:
        super().__init__(config)
        size = config.engine.parallel.tensor_parallel_size
        exchange = Exchange(size)
        self.pool = ThreadPoolExecutor(size)
        self.kv_outputs = KVOutputAggregator(size)

        def worker(r: int) -> Worker:
            ep = SINGLE_EP if dp is None else dp.ep_group(r, size)
            return Worker(config, r, tp=ThreadGroup(r, size, exchange=exchange), ep=ep)

        self.workers = list(self.pool.map(worker, range(size)))

    def execute_dummy_batch(self) -> list[torch.Tensor]:
        return list(self.pool.map(run_on_no_tokens, self.workers))

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


class ThreadDPGroup:
    """`dp` engines (each its own scheduler and KV cache) in threads, stepped in lockstep like
    one data-parallel wave: while any engine has unfinished requests every engine steps, and
    one with nothing to run runs the model on no tokens (`dummy_steps` counts them)."""

    def __init__(self, config: EngineConfig, dp: int) -> None:
        tp = config.parallel.tensor_parallel_size
        exchange = Exchange(dp * tp)
        self.busy = Exchange(dp)
        self.dummy_steps = [0] * dp

        def core(rank: int) -> EngineCore:
            return EngineCore(config, executor_cls=partial(ThreadExecutor, dp=DPRank(rank, dp, exchange)))

        # Together: each engine's warm-up forward pass is collective.
        with ThreadPoolExecutor(dp) as pool:
            self.cores = list(pool.map(core, range(dp)))

    def generate(self, requests: list[list[Request]]) -> dict[str, list[int]]:
        """requests[r] go to engine r; returns every request's output tokens by id."""
        for core, mine in zip(self.cores, requests):
            for request in mine:
                core.add_request(request)
        with ThreadPoolExecutor(len(self.cores)) as pool:
            outputs = list(pool.map(self._wave, range(len(self.cores))))
        return {rid: tokens for out in outputs for rid, tokens in out.items()}

    def _wave(self, rank: int) -> dict[str, list[int]]:
        core = self.cores[rank]
        tokens: dict[str, list[int]] = defaultdict(list)
        while True:
            ran_model = False
            if core.has_work():
                for out in core.step():
                    tokens[out.request_id].extend(out.new_token_ids)
                ran_model = not core.idle
            if not ran_model:
                core.executor.execute_dummy_batch()
                self.dummy_steps[rank] += 1
            flags = self.busy.all(rank, torch.tensor(core.has_unfinished_requests()))
            if not any(bool(f) for f in flags):
                return dict(tokens)

    def shutdown(self) -> None:
        for core in self.cores:
            core.shutdown()
