"""Multimodal inputs (docs/multimodal.md): images become placeholder tokens plus typed features on the
request; the scheduler runs their encoder within a budget and keeps the outputs in a cache
keyed by the image hash; the model runner merges them into the token embeddings."""

from engine.multimodal.features import MultiModalFeatures, MultiModalItem

__all__ = ["MultiModalFeatures", "MultiModalItem"]
