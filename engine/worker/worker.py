"""One rank's worker: its model runner, its share of the KV cache, and the worker side of the
KV connector. Executors call these methods (directly, or as collective RPCs)."""

from __future__ import annotations

from collections.abc import Callable

import torch

import kernels
from engine.distributed import SINGLE_EP, SINGLE_RANK, EPGroup, TPGroup
from engine.executor.base import WorkerConfig
from engine.kv_connector import KVConnectorFactory, KVConnectorRole, run_worker_step
from engine.sched.output import ModelRunnerOutput, SchedulerOutput
from engine.worker.cpu_tuning import keep_freed_memory_in_heap
from engine.worker.model_runner import ModelRunner


def kv_budget_bytes(total: int, free: int, reserved: int, allocated: int, peak: int, utilization: float,
                    base_allocated: int = 0, base_reserved: int = 0) -> int:
    """GPU bytes for this engine's KV cache, with vLLM's per-instance meaning of
    `gpu_memory_utilization`: the engine may use that fraction of the device in all (weights,
    its forward pass's peak, KV), whatever other engines or processes on the card hold, so two
    engines sharing a GPU take about 0.45 each. The KV, and next to it the activations of a
    full-budget forward pass, must also fit what is free now: the device's free memory plus
    what this process's allocator holds unused (`reserved - allocated`), less the forward
    pass's own `peak - allocated`.

    `reserved`, `allocated` and `peak` are this process's allocator figures after such a
    forward pass; `base_*` the same from before this worker loaded anything, so what the
    process held earlier (another engine, a reference model) is someone else's. Memory outside
    the allocator (the CUDA context, cuBLAS and NCCL workspaces) is not counted: the share
    should leave room for it, as the default 0.9 does."""
    gib = 2**30
    ours_peak = peak - base_allocated
    share = total * utilization
    budget = int(share - ours_peak)
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache at gpu_memory_utilization={utilization}: a forward "
            f"pass of this engine peaks at {ours_peak / gib:.1f} GiB of the {share / gib:.1f} GiB it may "
            "use; raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    available = free + reserved - peak
    if budget > available:
        others = total - free - (reserved - base_reserved)
        raise ValueError(
            f"gpu_memory_utilization={utilization} gives this engine {share / gib:.1f} GiB of "
            f"{total / gib:.1f} GiB, but only {available / gib:.1f} GiB are free for its "
            f"{budget / gib:.1f} GiB KV cache (others on the GPU use {others / gib:.1f} GiB): lower "
            "gpu_memory_utilization so that the engines sharing this GPU sum to at most about 0.9, "
            "or free the GPU"
        )
    return budget


class Worker:
    def __init__(self, config: WorkerConfig, rank: int = 0,
                 kv_connector_factory: KVConnectorFactory | None = None, tp: TPGroup = SINGLE_RANK,
                 ep: EPGroup = SINGLE_EP) -> None:
        self.config = config
        self.rank = rank
        self.tp = tp
        ec, sc = config.engine, config.scheduler
        if config.device.type == "cpu":
            keep_freed_memory_in_heap()
        # What this process held before this worker loaded anything (see kv_budget_bytes).
        self._memory_baseline = ((torch.cuda.memory_allocated(config.device),
                                  torch.cuda.memory_reserved(config.device))
                                 if config.device.type == "cuda" else (0, 0))
        torch.manual_seed(ec.model.seed)
        self.runner = ModelRunner(
            ec.model.model,
            config.arch,
            kernels.get_ops(config.kernel_backend, config.device.type),
            config.device,
            config.dtype,
            config.max_model_len,
            sc.max_num_seqs,
            sc.max_num_batched_tokens,
            ec.cache.block_size,
            ec.cache.effective_kernel_block_size,
            use_cuda_graphs=config.use_cuda_graphs,
            tp=tp,
            ep=ep,
            speculative=ec.speculative,
            quantization=ec.model.quantization,
            lora=ec.lora,
            pooling=config.pooling,
        )
        self.kv_connector = (kv_connector_factory(KVConnectorRole.WORKER)
                             if kv_connector_factory is not None else None)

    # ---- KV cache -----------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block()

    def determine_available_memory(self) -> int:
        if self.config.device.type != "cuda":
            raise RuntimeError("memory profiling needs CUDA; size the KV cache explicitly on CPU")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.runner.profile_run(self.config.scheduler.max_num_batched_tokens)
        free, total = torch.cuda.mem_get_info()
        base_allocated, base_reserved = self._memory_baseline
        return kv_budget_bytes(
            total, free, torch.cuda.memory_reserved(), torch.cuda.memory_allocated(),
            torch.cuda.max_memory_allocated(), self.config.engine.cache.gpu_memory_utilization,
            base_allocated, base_reserved,
        )

    def profile_run(self, num_tokens: int) -> None:
        self.runner.profile_run(num_tokens)

    def execute_dummy_batch(self) -> None:
        self.runner.execute_dummy_batch()

    def initialize_kv_cache(self, num_blocks: int, num_window_blocks: int = 0) -> None:
        self.runner.initialize_kv_cache(num_blocks, num_window_blocks)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.runner.kv_caches, self.runner.layer_groups)

    def kv_transfer_stats(self) -> dict:
        return self.kv_connector.transfer_stats() if self.kv_connector is not None else {}

    def kv_outbox_size(self) -> int:
        return self.kv_connector.pending_exports() if self.kv_connector is not None else 0

    def set_kv_wakeup(self, callback: Callable[[], None]) -> None:
        if self.kv_connector is not None:
            self.kv_connector.set_wakeup(callback)

    # ---- step ---------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output, kv_output = run_worker_step(
            self.kv_connector, scheduler_output.kv_connector_metadata,
            lambda: self.runner.execute_model(scheduler_output),
        )
        if kv_output is not None and not kv_output.is_empty:
            output.kv_connector_output = kv_output
        return output
