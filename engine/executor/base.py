"""The Executor interface and the resolved configuration every worker is built from."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import EngineConfig, SchedulerConfig
from engine.distributed import SINGLE_DP, DPPlacement
from engine.executor.kv_aggregate import KVOutputAggregator
from engine.models.arch import ModelArch
from engine.pooling.config import PoolingModel
from engine.sched.output import ModelRunnerOutput, SchedulerOutput


def rank_reply(is_driver: bool, method: str, result: Any) -> Any:
    """What a rank sends back for one call. For a step only the driver's sampled tokens
    matter, but every rank's KV-connector report does (each moves its own heads)."""
    if method == "execute_model" and not is_driver:
        return result.kv_connector_output
    return result


def merge_step_replies(replies: list[Any], aggregator: KVOutputAggregator,
                       scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
    """Rank 0's ModelRunnerOutput carrying the group's KV-connector report (see
    kv_aggregate): replies[0] is rank 0's output, the others their connector reports."""
    output: ModelRunnerOutput = replies[0]
    aggregator.forget(scheduler_output.finished_req_ids)
    output.kv_connector_output = aggregator.merge([output.kv_connector_output, *replies[1:]])
    return output


@dataclass(frozen=True)
class WorkerConfig:
    """An EngineConfig with everything a worker must not decide on its own resolved once by
    the EngineCore (device, dtype, context length, token budget, kernel backend), so every
    rank builds the same model runner."""

    engine: EngineConfig
    arch: ModelArch
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    scheduler: SchedulerConfig  # max_num_batched_tokens resolved for the device
    kernel_backend: str  # "triton" or "torch"
    dp: DPPlacement = SINGLE_DP  # this engine core's place among the data-parallel cores
    pooling: PoolingModel | None = None  # a pooling model's rules (engine.pooling); None: generates

    @property
    def use_cuda_graphs(self) -> bool:
        # Collectives are not captured into graphs: a sharded model decodes eagerly (and the
        # expert exchange's sizes change every step).
        parallel = self.engine.parallel
        # LoRA's per-step token -> slot mapping is not a captured input either. A pooling engine
        # never decodes: nothing would replay the graphs.
        return (self.device.type == "cuda" and self.kernel_backend == "triton" and not self.engine.enforce_eager
                and parallel.tensor_parallel_size == 1 and parallel.expert_parallel_size == 1
                and self.engine.lora is None and self.pooling is None)


class Executor(ABC):
    """What the EngineCore needs from its workers. Every method is a collective: it reaches
    all workers and, where workers answer, returns what the driver rank (rank 0) says."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step on every worker; the sampled tokens (and the KV
        connector's report) come from the driver rank."""

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Call `method` on every worker; one result per rank, in rank order."""

    # ---- KV cache sizing ----------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        """Bytes of one KV block on the rank that holds the most (ranks may differ)."""
        return max(self.collective_rpc("kv_bytes_per_block"))

    def determine_available_memory(self) -> int:
        """Bytes each rank can give the KV cache after a full-budget profiling forward pass
        (the least of all ranks: block tables are the same everywhere)."""
        return min(self.collective_rpc("determine_available_memory"))

    def initialize_kv_cache(self, num_blocks: int, num_window_blocks: int = 0) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks, num_window_blocks))

    def profile_run(self, num_tokens: int) -> None:
        self.collective_rpc("profile_run", (num_tokens,))

    def execute_dummy_batch(self) -> None:
        """A forward pass on no tokens on every rank: an idle data-parallel core's step, so
        that the busy cores' expert-parallel collectives find its ranks there (docs/parallel.md#waves-and-dummy-batches)."""
        self.collective_rpc("execute_dummy_batch")

    def set_kv_wakeup(self, callback) -> None:
        """Give the KV connector's worker side the engine loop's wake-up (in-process
        workers only: executors whose ranks live elsewhere leave the loop to poll)."""
        self.collective_rpc("set_kv_wakeup", (callback,))

    def rank_actors(self) -> list:
        """The tensor-parallel rank actors ("ray" executor), for operators and tests that reach
        a rank's own state; none for ranks that are threads or processes."""
        return []

    def check_health(self) -> None:
        """Raise if a worker is known to be gone (a health check between steps); the
        in-process worker cannot be."""
        return None

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers (processes, actors, device memory). Idempotent."""


class RankGroupExecutor(Executor):
    """An executor over several rank processes (the "mp" and "ray" backends): a step goes to
    every rank through `collective_rpc`, and rank 0's output comes back carrying the group's
    merged KV-connector report (`kv_outputs`, set by the subclass)."""

    kv_outputs: KVOutputAggregator

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        replies = self.collective_rpc("execute_model", (scheduler_output,))
        return merge_step_replies(replies, self.kv_outputs, scheduler_output)
