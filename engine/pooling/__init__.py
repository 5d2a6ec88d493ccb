"""Pooling models: embeddings and scores from the same engine (docs/pooling.md)."""

from engine.pooling.config import PoolerConfig, PoolingModel, PoolingSetting, pooling_model
from engine.pooling.params import PoolingParams

__all__ = ["PoolerConfig", "PoolingModel", "PoolingParams", "PoolingSetting", "pooling_model"]
