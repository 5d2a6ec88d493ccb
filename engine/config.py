"""Frozen configuration, one dataclass per layer, validated on construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.errors import ParameterError, check_choice, check_int
from engine.lora.config import LoRAConfig
from engine.pooling.config import PoolingSetting
from engine.spec_decode.config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
# engine.models.quant_linear (gguf), engine.models.hf_quant_config (the checkpoint's method)
QUANTIZATION_METHODS = ("gguf", "gptq", "awq", "compressed-tensors", "none")
POLICIES = ("fcfs", "priority")
# What the engine is for (vLLM's usage context): it picks defaults, never behaviour.
USAGE_CONTEXTS = ("offline", "serving")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "triton", "torch")
# vLLM's names. "uni": one worker in the engine's process; "mp": one process per rank on this
# node; "ray": one Ray actor per rank (registered from outside the engine, which never imports
# Ray). None picks "uni" for one rank and "mp" for more.
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
# How data-parallel engine cores run (vLLM's --data-parallel-backend): "mp", one process per
# rank on this node; "ray", one Ray actor per rank (registered from outside the engine).
DP_BACKENDS = ("mp", "ray")
# Engine hang watchdog (engine.async_llm, engine.core_client): an engine step, or a core apart
# from its front end, silent for longer fails the engine (its requests end with an error, its
# replica's health check fails). The slowest healthy step measured: 12 s, the default model's
# 512-token chunk at a 2k context on a loaded 2-core CPU; a model ten times larger takes about
# two minutes there. 300 s is more than twice that, and the bound the ranks' own collectives
# already have (engine.distributed.COLLECTIVE_TIMEOUT). On GPUs a step takes well under a
# second: 60 s (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S) finds a hang sooner.
ENGINE_STEP_TIMEOUT_S = 300.0
# The least bound: a core apart says it is alive every engine.core_client.watchdog.HEARTBEAT_S.
MIN_ENGINE_STEP_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ModelConfig:
    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    device: str = "auto"
    # Most logprobs (and prompt logprobs) a request may ask for (vLLM's max_logprobs).
    max_logprobs: int = 20
    # How weights are held (engine.models.quant_linear): None = "gguf" for a GGUF file.
    quantization: str | None = None

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, DTYPES)
        if self.quantization is not None:
            check_choice("quantization", self.quantization, QUANTIZATION_METHODS)
        check_int("max_logprobs", self.max_logprobs, 0)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 2)
        check_choice("device", self.device, DEVICES)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_gb: float | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    # Attention kernels may page at a finer granularity than the allocator (docs/architecture.md#contracts):
    # each allocation block is split into block_size // kernel_block_size kernel blocks.
    kernel_block_size: int | None = None
    # Sliding-window layers keep all their blocks, as full attention does (vLLM's flag).
    disable_hybrid_kv_cache_manager: bool = False
    # Record KV events (engine.kv_cache.events) for a KV-aware router (vLLM's
    # kv_events_config.enable_kv_cache_events); needs prefix caching.
    enable_kv_cache_events: bool = False

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size)
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ParameterError("kv_cache_memory_gb", f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.num_kv_blocks is not None:
            check_int("num_kv_blocks", self.num_kv_blocks)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ParameterError(
                "gpu_memory_utilization", f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kernel_block_size is not None:
            check_int("kernel_block_size", self.kernel_block_size)
            if self.block_size % self.kernel_block_size:
                raise ParameterError(
                    "kernel_block_size", f"kernel_block_size ({self.kernel_block_size}) must divide "
                    f"block_size ({self.block_size})"
                )

    @property
    def effective_kernel_block_size(self) -> int:
        return self.kernel_block_size or self.block_size


# How the host KV tier keeps its blocks (vLLM's --kv-offloading-backend): "native", the
# engine's own host pool (engine.kv_offload).
KV_OFFLOADING_BACKENDS = ("native",)


@dataclass(frozen=True)
class KVSharedTierConfig:
    """The cluster's shared KV tier (kvstore.shared_tier; `--kv-shared-tier-size`): prefix
    blocks one replica computed, held for all of an app's replicas in `size_gb` GiB of Ray's
    object store (cluster-wide: the first replica to open the tier sets it). The engine only
    carries the setting: a replica host builds the tier; an engine without one (offline `LLM`)
    logs that it is off."""

    size_gb: float

    def __post_init__(self) -> None:
        size = self.size_gb
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 < size < float("inf"):
            raise ParameterError("kv_shared_tier_size", f"kv_shared_tier_size is the shared KV tier's size in "
                                 f"GiB and must be > 0 (leave it unset for no tier), got {size!r}")

    @property
    def size_bytes(self) -> int:
        return int(self.size_gb * 2**30)


@dataclass(frozen=True)
class KVOffloadConfig:
    """The engine's host KV tier (engine.kv_offload; vLLM's --kv-offloading-size): prefix
    blocks kept in `size_gb` GiB of host memory after the engine's own pool evicted them (per
    engine core: data-parallel cores have one each)."""

    size_gb: float
    backend: str = "native"

    def __post_init__(self) -> None:
        size = self.size_gb
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 < size < float("inf"):
            raise ParameterError("kv_offloading_size", f"kv_offloading_size is the host KV tier's size in GiB "
                                 f"and must be > 0 (leave it unset for no tier), got {size!r}")
        check_choice("kv_offloading_backend", self.backend, KV_OFFLOADING_BACKENDS)

    @property
    def size_bytes(self) -> int:
        return int(self.size_gb * 2**30)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    # None: the default of the device and usage context (`resolved_token_budget`).
    max_num_batched_tokens: int | None = None
    # 0 disables the cap; a positive value chunks long prefills to at most this many tokens.
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    # "serving" for the engines behind `pdserve serve`, the P/D actors and
    # AsyncLLM.from_engine_args; "offline" for LLM, batch jobs and the bench scripts: only
    # the default token budget differs.
    usage_context: str = "offline"

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs)
        check_choice("usage_context", self.usage_context, USAGE_CONTEXTS)
        if self.max_num_batched_tokens is not None:
            check_int("max_num_batched_tokens", self.max_num_batched_tokens)
        check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        check_choice("scheduling_policy", self.scheduling_policy, POLICIES)


# CPU token budgets. Offline, 2048 rather than CUDA's 8192: smaller steps keep activations in
# cache (+25% throughput on the 2-core benchmark). Serving, 512: a step's prompts all get
# their first token when the step ends, and on CPU a step costs what its tokens cost, so a
# 2048-token step made every prompt of a burst wait for the whole burst and, in P/D, left the
# decode engine idle meanwhile. On SmolLM2 at 8 streams (docs/benchmarks.md#token-budget-when-serving):
# P/D +14-31% tok/s and a 3-4x lower median TTFT; colocated a 2x lower median TTFT for a
# 20-50% higher median ITL. Offline the smaller budget was no faster, so LLM and batch jobs
# keep 2048.
_CPU_TOKEN_BUDGET = {"offline": 2048, "serving": 512}
_CUDA_TOKEN_BUDGET = 8192


def resolved_token_budget(config: SchedulerConfig, device_type: str) -> SchedulerConfig:
    """The scheduler config with the per-step token budget fixed for the device and the
    usage context (an explicit max_num_batched_tokens is kept)."""
    if config.max_num_batched_tokens is not None:
        return config
    budget = _CUDA_TOKEN_BUDGET if device_type == "cuda" else _CPU_TOKEN_BUDGET[config.usage_context]
    return dataclasses.replace(config, max_num_batched_tokens=budget)


@dataclass(frozen=True)
class MultiModalConfig:
    """Multimodal limits (vLLM's names). Ignored for a text-only model."""

    # Images one prompt may carry.
    limit_mm_per_prompt: int = 4
    # Encoder cache capacity and per-step encoder budget, in encoder output embeddings
    # (placeholder tokens). None: the step's token budget. Both are raised to at least one
    # image's worth, since one image's encoder run is never split.
    encoder_cache_size: int | None = None
    max_num_encoder_input_tokens: int | None = None

    def __post_init__(self) -> None:
        check_int("limit_mm_per_prompt", self.limit_mm_per_prompt, 0)
        if self.encoder_cache_size is not None:
            check_int("encoder_cache_size", self.encoder_cache_size)
        if self.max_num_encoder_input_tokens is not None:
            check_int("max_num_encoder_input_tokens", self.max_num_encoder_input_tokens)

    def budgets(self, step_tokens: int, tokens_per_item: int) -> tuple[int, int]:
        """(encoder cache size, per-step encoder budget) resolved for a model and device."""
        size = self.encoder_cache_size or step_tokens
        budget = self.max_num_encoder_input_tokens or step_tokens
        return max(size, tokens_per_item), max(budget, tokens_per_item)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    # Engine cores, each with its own scheduler and KV cache (engine.dp); the tensor-parallel
    # ranks above are per core.
    data_parallel_size: int = 1
    data_parallel_backend: str | None = None  # None: "mp" offline (the cluster picks "ray")
    # The experts of every MoE layer are partitioned whole over data_parallel_size x
    # tensor_parallel_size ranks instead of being TP-sliced; attention stays data parallel.
    enable_expert_parallel: bool = False
    # One engine core in a child process of its own (engine.core_client.CoreProcClient), as
    # vLLM V1 runs EngineCoreProc: the front end's threads then never hold the GIL that the
    # engine loop needs between its torch ops.
    engine_core_process: bool = False

    def __post_init__(self) -> None:
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_int("data_parallel_size", self.data_parallel_size, 1)
        if self.engine_core_process:
            self._check_core_process()
        if self.data_parallel_backend is not None:
            check_choice("data_parallel_backend", self.data_parallel_backend, DP_BACKENDS)
        if self.distributed_executor_backend is not None:
            check_choice("distributed_executor_backend", self.distributed_executor_backend, EXECUTOR_BACKENDS)
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ParameterError(
                "distributed_executor_backend",
                f"distributed_executor_backend='uni' runs one rank, but tensor_parallel_size="
                f"{self.tensor_parallel_size}; use 'mp' or 'ray' (or tensor_parallel_size=1)",
            )

    def _check_core_process(self) -> None:
        if self.data_parallel_size > 1:
            raise ParameterError("engine_core_process", "engine_core_process runs one engine core apart from its "
                                 f"front end; data_parallel_size={self.data_parallel_size} cores already run in "
                                 "processes (or actors) of their own: leave engine_core_process off")
        if self.data_parallel_backend == "ray":
            raise ParameterError("engine_core_process", "engine_core_process runs the core as a child process, "
                                 "not as a Ray actor; got data_parallel_backend='ray' (for data_parallel_size > 1)")
        if self.distributed_executor_backend == "ray":
            raise ParameterError("engine_core_process", "the engine core's child process is not a Ray worker, so "
                                 "its tensor-parallel ranks cannot be Ray actors: give distributed_executor_backend "
                                 "'mp' (or leave engine_core_process off)")

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.tensor_parallel_size == 1 else "mp"

    @property
    def dp_backend(self) -> str:
        return self.data_parallel_backend or "mp"

    @property
    def expert_parallel_size(self) -> int:
        """Ranks the experts are partitioned over (1: every rank holds every expert)."""
        return self.data_parallel_size * self.tensor_parallel_size if self.enable_expert_parallel else 1

    @property
    def lockstep(self) -> bool:
        """Whether the data-parallel cores must step together: only when expert parallelism
        makes every forward pass a collective over all of them (docs/parallel.md#waves-and-dummy-batches: waves and dummy
        batches). Without it each core is an independent engine behind one load balancer."""
        return self.data_parallel_size > 1 and self.enable_expert_parallel


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)
    # Which implementation of the kernel contract to run: "auto" is Triton on CUDA and the
    # torch references on CPU; "triton" / "torch" force one.
    kernel_backend: str = "auto"
    # Run decode steps eagerly instead of replaying CUDA graphs (graphs need CUDA + Triton).
    enforce_eager: bool = False
    # Speculative decoding (engine.spec_decode); None: one token per request per step.
    speculative: SpeculativeConfig | None = None
    # Multi-LoRA (engine.lora); None: enable_lora is off and requests name no adapter.
    lora: LoRAConfig | None = None
    # The host KV tier (engine.kv_offload); None: off.
    kv_offload: KVOffloadConfig | None = None
    # The cluster's shared KV tier (kvstore.shared_tier); None: off.
    kv_shared_tier: KVSharedTierConfig | None = None
    # Seconds an engine step (or a silence of a core apart) may last before the engine is failed
    # as hung; 0: no bound.
    engine_step_timeout_s: float = ENGINE_STEP_TIMEOUT_S
    # --runner / --convert / --pooler-config / --hf-overrides (engine.pooling); whether this
    # engine pools depends on the model too (PoolingSetting.is_pooling).
    pooling: PoolingSetting = field(default_factory=PoolingSetting)

    def __post_init__(self) -> None:
        check_choice("kernel_backend", self.kernel_backend, BACKENDS)
        t = self.engine_step_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (
                t == 0 or MIN_ENGINE_STEP_TIMEOUT_S <= t <= 86400):
            raise ParameterError("engine_step_timeout_s", f"engine_step_timeout_s must be 0 (no bound) or in "
                                 f"[{MIN_ENGINE_STEP_TIMEOUT_S:g}, 86400] seconds, got {t!r}")
        if self.kv_offload is not None:
            self._check_kv_offload()
        if self.kv_shared_tier is not None:
            self._check_kv_shared_tier()
        if self.lora is not None and self.parallel.tensor_parallel_size > 1:
            raise ParameterError("enable_lora", "enable_lora runs with tensor_parallel_size=1 (each "
                                 "data-parallel core or replica holds the whole model and its adapters), "
                                 f"got tensor_parallel_size={self.parallel.tensor_parallel_size}")

    def _check_kv_shared_tier(self) -> None:
        if not self.cache.enable_prefix_caching:
            raise ParameterError("kv_shared_tier_size", "kv_shared_tier_size shares prefix-cache blocks: it "
                                 "needs enable_prefix_caching")
        p = self.parallel
        if p.tensor_parallel_size > 1 or p.data_parallel_size > 1 or p.engine_core_process:
            raise ParameterError("kv_shared_tier_size", "kv_shared_tier_size runs with one engine core in the "
                                 "replica's process (tensor_parallel_size=1, data_parallel_size=1, no "
                                 "engine_core_process): the tier's connector calls the cluster from there")

    def _check_kv_offload(self) -> None:
        if not self.cache.enable_prefix_caching:
            raise ParameterError("kv_offloading_size", "kv_offloading_size keeps prefix-cache blocks in host "
                                 "memory: it needs enable_prefix_caching")
        if self.parallel.tensor_parallel_size > 1:
            raise ParameterError("kv_offloading_size", "kv_offloading_size runs with tensor_parallel_size=1 "
                                 f"(got {self.parallel.tensor_parallel_size}); each data-parallel core or "
                                 "replica keeps a tier of its own")
