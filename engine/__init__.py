"""pdserve engine: a paged-KV, continuously batching LLM engine (never imports Ray).

The names below load on first use: `import engine.load` (or any light module of the engine)
must not import torch and transformers with them, since processes that only read the
engine's types (the Coordinator, the KV store actor) would pay seconds to start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "LLM": "engine.llm",
    "AsyncLLM": "engine.async_llm",
    "CacheConfig": "engine.config",
    "CompletionOutput": "engine.outputs",
    "EngineArgs": "engine.args",
    "EngineConfig": "engine.config",
    "ModelConfig": "engine.config",
    "ParameterError": "engine.errors",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
    "SchedulerConfig": "engine.config",
    "StructuredOutputsParams": "engine.structured_output",
}
__all__ = [
    "AsyncLLM",
    "CacheConfig",
    "CompletionOutput",
    "EngineArgs",
    "EngineConfig",
    "LLM",
    "ModelConfig",
    "ParameterError",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "StructuredOutputsParams",
]

if TYPE_CHECKING:
    from engine.args import EngineArgs
    from engine.async_llm import AsyncLLM
    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.errors import ParameterError
    from engine.llm import LLM
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.sampling_params import SamplingParams
    from engine.structured_output import StructuredOutputsParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
