"""EngineArgs: every engine argument, once, under vLLM's names.

Every entry point takes an `EngineArgs`: `LLM(**kwargs)`, `AsyncLLM.from_engine_args`, the
P/D actors, the Serve application config, `pdserve serve/generate/batch` and the bench
scripts. A new engine argument is one field here: it appears in every `--help` (through
`add_cli_args`), in the Serve config, and reaches the engine through `create_engine_config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field

from engine.config import (
    BACKENDS,
    DEVICES,
    DP_BACKENDS,
    DTYPES,
    ENGINE_STEP_TIMEOUT_S,
    EXECUTOR_BACKENDS,
    KV_OFFLOADING_BACKENDS,
    POLICIES,
    QUANTIZATION_METHODS,
    CacheConfig,
    EngineConfig,
    KVOffloadConfig,
    KVSharedTierConfig,
    ModelConfig,
    MultiModalConfig,
    ParallelConfig,
    SchedulerConfig,
)
from engine.errors import ParameterError, check_choice
from engine.kv_connector import DEFAULT_LOAD_FAILURE_POLICY, LOAD_FAILURE_POLICIES
from engine.lora.config import LoRAConfig
from engine.pooling.config import CONVERTS, RUNNERS, PoolingSetting
from engine.spec_decode.config import SpeculativeConfig


def _arg(default, help: str, choices: tuple | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class EngineArgs:
    model: str = _arg("", "a Hugging Face model directory (config.json, safetensors, tokenizer), a "
                       ".gguf file, or a directory holding one .gguf file (pdserve commands: "
                       "SmolLM2-135M-Instruct by default)")
    # model
    dtype: str = _arg("auto", "weights and activations dtype (auto: the checkpoint's on CUDA, "
                      "float32 on CPU)", DTYPES)
    max_model_len: int | None = _arg(None, "context length (default: the model's)")
    seed: int = _arg(0, "random seed of the engine (weights init order, unseeded sampling)")
    device: str = _arg("auto", "device to run on (auto: CUDA when available)", DEVICES)
    max_logprobs: int = _arg(20, "most logprobs and prompt logprobs a request may ask for")
    quantization: str | None = _arg(None, "how weights are held: gguf keeps a GGUF file's blocks and "
                                    "multiplies by them (the default for a .gguf model); gptq, awq, "
                                    "compressed-tensors name a checkpoint's quantization_config "
                                    "method (the default: the checkpoint's); none dequantizes at load",
                                    QUANTIZATION_METHODS)
    # pooling (docs/pooling.md)
    runner: str = _arg("auto", "generate text, or pool each prompt into an embedding or scores (auto: pooling "
                       "for a *ForSequenceClassification checkpoint or --convert embed/classify)", RUNNERS)
    convert: str = _arg("auto", "what a pooling model answers: embed (embeddings) or classify (scores: a "
                        "classifier checkpoint, or an LLM's classifier_from_token logits)", CONVERTS)
    pooler_config: dict | None = _arg(
        None, 'override the model\'s pooling, as a JSON object: {"pooling_type": "LAST"|"MEAN"|"CLS", '
        '"normalize": true, "dimensions": N} (default: the sentence-transformers config, else LAST, normalized)')
    hf_overrides: dict | None = _arg(
        None, 'config keys a pooling model reads, as a JSON object: classifier_from_token (["no", "yes"]), '
        'is_matryoshka, matryoshka_dimensions, architectures, num_labels')
    # cache
    block_size: int = _arg(16, "tokens per KV cache block")
    enable_prefix_caching: bool = _arg(True, "reuse the KV of shared prompt prefixes")
    kv_cache_memory_gb: float | None = _arg(None, "memory for the KV cache in GiB (default: from "
                                            "gpu_memory_utilization on CUDA, 1 GiB on CPU)")
    num_kv_blocks: int | None = _arg(None, "number of KV cache blocks (overrides kv_cache_memory_gb)")
    gpu_memory_utilization: float = _arg(0.9, "fraction of GPU memory the engine may use")
    kernel_block_size: int | None = _arg(None, "tokens per attention-kernel page (divides block_size)")
    disable_hybrid_kv_cache_manager: bool = _arg(False, "keep every block of a sliding-window layer "
                                                 "(default: free those out of every window)")
    kv_events_config: dict | None = _arg(
        None, 'KV cache events for a KV-aware router, as a JSON object: {"enable_kv_cache_events": true} '
        '(publisher "null": pdserve\'s routers read them in-process; serve --router-mode kv turns them on)')
    kv_offloading_size: float | None = _arg(None, "host memory in GiB for a second KV tier: prefix blocks "
                                            "evicted from the KV cache are loaded from there instead of "
                                            "recomputed (default: no tier)")
    kv_offloading_backend: str = _arg("native", "how the host KV tier keeps its blocks",
                                      KV_OFFLOADING_BACKENDS)
    kv_shared_tier_size: float | None = _arg(None, "GiB of Ray's object store for a KV tier shared by an "
                                             "app's replicas: a prefix one replica computed is loaded by "
                                             "another (cluster-wide; serving only, default: no tier)")
    # scheduler
    max_num_seqs: int = _arg(256, "most requests in one step")
    max_num_batched_tokens: int | None = _arg(None, "token budget of one step (default: 8192 on "
                                              "CUDA; on CPU 512 when serving, 2048 offline)")
    long_prefill_token_threshold: int = _arg(0, "chunk prompts longer than this per step (0: off)")
    scheduling_policy: str = _arg("fcfs", "order of the waiting queue", POLICIES)
    # multimodal
    limit_mm_per_prompt: dict | str | None = _arg(
        None, 'images per prompt, as {"image": N} (a JSON string on the command line; default 4)')
    encoder_cache_size: int | None = _arg(None, "encoder cache capacity in image embeddings (default: "
                                          "max_num_batched_tokens)")
    max_num_encoder_input_tokens: int | None = _arg(None, "image embeddings encoded per step at most "
                                                    "(default: max_num_batched_tokens)")
    allowed_local_media_path: str | None = _arg(
        None, "a directory whose files chat requests may name as file:// image URLs (default: none; "
        "remote URLs are never fetched)")
    # LoRA
    enable_lora: bool = _arg(False, "serve LoRA adapters: a request may name one (LoRARequest offline, "
                             "its `model` online)")
    max_loras: int = _arg(1, "adapters in one step (device slots)")
    max_lora_rank: int = _arg(16, "highest adapter rank accepted (slots are sized for it)")
    max_cpu_loras: int | None = _arg(None, "adapters kept loaded in host memory behind the slots, LRU "
                                     "(default: max_loras)")
    # execution
    kernel_backend: str = _arg("auto", "kernel implementation (auto: Triton on CUDA, torch on CPU)",
                               BACKENDS)
    enforce_eager: bool = _arg(False, "never replay CUDA graphs for decode")
    speculative_config: dict | None = _arg(
        None, 'speculative decoding, as a JSON object: {"method": "ngram", "num_speculative_tokens": '
        '3, "prompt_lookup_max": 5, "prompt_lookup_min": 2} (default: off)')
    # parallelism
    tensor_parallel_size: int = _arg(1, "ranks the model is sharded over (heads, MLP and vocabulary "
                                     "split; one GPU per rank on CUDA, gloo on CPU)")
    distributed_executor_backend: str | None = _arg(
        None, "how ranks run: mp (processes on this node), ray (one actor per rank) or uni (one "
        "rank in the engine's process); default: uni for one rank, mp for more", EXECUTOR_BACKENDS)
    data_parallel_size: int = _arg(1, "engine cores, each with its own scheduler and KV cache, behind one "
                                   "load balancer (each core has tensor_parallel_size ranks)")
    data_parallel_backend: str | None = _arg(
        None, "how data-parallel cores run: mp (processes on this node) or ray (one actor per core, all "
        "placed by one placement group); default: mp offline, ray in the cluster", DP_BACKENDS)
    enable_expert_parallel: bool = _arg(False, "partition each MoE layer's experts whole over "
                                        "data_parallel_size x tensor_parallel_size ranks (MoE models only)")
    engine_core_process: bool = _arg(False, "run the engine core (scheduler, KV cache, model) in a child "
                                     "process, as vLLM V1 does, so the front end's Python threads never hold "
                                     "the GIL the engine loop needs; one core (a P/D replica's KV transfers "
                                     "are relayed through its own process)")
    engine_step_timeout_s: float = _arg(
        ENGINE_STEP_TIMEOUT_S, "an engine step or collective, or an engine core process's silence, longer than "
        "this fails the engine as hung: its requests end with an error and its replica's health check fails "
        "(0: no bound)")
    # P/D (vLLM's KVTransferConfig field of this name; pdserve's default: engine.kv_connector)
    kv_load_failure_policy: str = _arg(
        DEFAULT_LOAD_FAILURE_POLICY, "a P/D decode request whose prompt KV is lost, late or malformed: "
        "recompute computes the prompt on the decode replica, fail ends the request with an error",
        LOAD_FAILURE_POLICIES)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> EngineArgs:
        """`LLM(model, **kwargs)`: unknown names are a ParameterError listing the allowed ones."""
        unknown = sorted(set(kwargs) - set(cls.field_names()))
        if unknown:
            raise ParameterError(
                unknown[0], f"unknown engine arguments {unknown}; allowed: {sorted(cls.field_names())}"
            )
        return cls(model=model, **kwargs)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes) -> EngineArgs:
        return dataclasses.replace(self, **changes)

    # ---- command line -------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        """Add one `--flag-name` per field (booleans as `--x/--no-x`, as vLLM's CLI does).
        `--model` defaults to None so a CLI can substitute its own default model."""
        group = parser.add_argument_group("engine arguments")
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            help_ = f.metadata.get("help", "")
            choices = f.metadata.get("choices")
            if f.name == "model":
                group.add_argument(flag, default=None, help=help_)
            elif isinstance(f.default, bool):
                group.add_argument(flag, default=f.default, action=argparse.BooleanOptionalAction,
                                   help=help_)
            else:
                if "default" not in help_:
                    help_ = f"{help_} (default: {f.default})"
                group.add_argument(flag, default=f.default, type=_cli_type(f.type), choices=choices,
                                   help=help_)
        return parser

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace, **overrides) -> EngineArgs:
        values = {name: getattr(namespace, name) for name in cls.field_names() if hasattr(namespace, name)}
        values.update(overrides)
        return cls(**values)

    # ---- to the engine ------------------------------------------------------------------
    def create_engine_config(self, usage_context: str = "offline") -> EngineConfig:
        """The frozen per-layer configs; every value is validated there (ParameterError).
        `usage_context`: "serving" for engines behind the server (engine.config.USAGE_CONTEXTS),
        which changes defaults only."""
        if not isinstance(self.model, str) or not self.model:
            raise ParameterError("model", f"model must be a model directory or .gguf file, got {self.model!r}")
        # Read by the P/D connector (kvstore.connector), which no engine config carries.
        check_choice("kv_load_failure_policy", self.kv_load_failure_policy, LOAD_FAILURE_POLICIES)
        check_choice("kv_offloading_backend", self.kv_offloading_backend, KV_OFFLOADING_BACKENDS)
        return EngineConfig(
            model=ModelConfig(model=self.model, dtype=self.dtype, max_model_len=self.max_model_len,
                              seed=self.seed, device=self.device, max_logprobs=self.max_logprobs,
                              quantization=self.quantization),
            cache=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory_gb=self.kv_cache_memory_gb,
                num_kv_blocks=self.num_kv_blocks,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kernel_block_size=self.kernel_block_size,
                disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager,
                enable_kv_cache_events=_kv_events_enabled(self.kv_events_config),
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                scheduling_policy=self.scheduling_policy,
                usage_context=usage_context,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
                data_parallel_size=self.data_parallel_size,
                data_parallel_backend=self.data_parallel_backend,
                enable_expert_parallel=self.enable_expert_parallel,
                engine_core_process=self.engine_core_process,
            ),
            multimodal=MultiModalConfig(
                limit_mm_per_prompt=_image_limit(self.limit_mm_per_prompt),
                encoder_cache_size=self.encoder_cache_size,
                max_num_encoder_input_tokens=self.max_num_encoder_input_tokens,
            ),
            kernel_backend=self.kernel_backend,
            enforce_eager=self.enforce_eager,
            speculative=SpeculativeConfig.from_user(self.speculative_config),
            lora=LoRAConfig.from_args(self.enable_lora, self.max_loras, self.max_lora_rank, self.max_cpu_loras),
            engine_step_timeout_s=self.engine_step_timeout_s,
            kv_offload=(None if self.kv_offloading_size is None
                        else KVOffloadConfig(self.kv_offloading_size, self.kv_offloading_backend)),
            kv_shared_tier=(None if self.kv_shared_tier_size is None
                            else KVSharedTierConfig(self.kv_shared_tier_size)),
            pooling=PoolingSetting.from_args(self.runner, self.convert, self.pooler_config, self.hf_overrides),
        )


def _image_limit(value) -> int:
    """limit_mm_per_prompt as vLLM takes it ({"image": N}, or that as JSON) -> N."""
    if value is None:
        return MultiModalConfig.limit_mm_per_prompt
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    if not isinstance(value, dict) or set(value) - {"image"}:
        raise ParameterError("limit_mm_per_prompt", 'limit_mm_per_prompt must be {"image": N} with N >= 0, '
                             f"got {value!r}")
    return value.get("image", MultiModalConfig.limit_mm_per_prompt)


def _kv_events_enabled(value) -> bool:
    """kv_events_config as vLLM takes it -> whether events are recorded. Only the in-process
    publisher exists here: a ZMQ endpoint would be a promise nothing keeps."""
    if value is None:
        return False
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    allowed = {"enable_kv_cache_events", "publisher"}
    if not isinstance(value, dict) or set(value) - allowed or value.get("publisher", "null") != "null" or (
            not isinstance(value.get("enable_kv_cache_events", False), bool)):
        raise ParameterError("kv_events_config", 'kv_events_config must be {"enable_kv_cache_events": true|false} '
                             f'(publisher "null" only), got {value!r}')
    return value.get("enable_kv_cache_events", False)


def _cli_type(annotation: str):
    """argparse type of a field from its (string) annotation."""
    if annotation.startswith("int"):
        return int
    if annotation.startswith("float"):
        return float
    if annotation.startswith("dict"):
        return _json_object
    return str


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value
