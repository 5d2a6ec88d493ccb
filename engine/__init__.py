"""pdserve engine: a paged-KV, continuously batching LLM engine (never imports Ray)."""

from engine.async_llm import AsyncLLM
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm import LLM, build_engine_config
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "CacheConfig",
    "CompletionOutput",
    "EngineConfig",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "build_engine_config",
]
