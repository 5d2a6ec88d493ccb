"""Token sampling."""

from engine.sample.sampler import Sampler, SamplingMetadata

__all__ = ["Sampler", "SamplingMetadata"]
