"""pdserve engine: a paged-KV, continuously batching LLM engine (never imports Ray)."""

from engine.args import EngineArgs
from engine.async_llm import AsyncLLM
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.errors import ParameterError
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "CacheConfig",
    "CompletionOutput",
    "EngineArgs",
    "EngineConfig",
    "ModelConfig",
    "ParameterError",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "StructuredOutputsParams",
]
