"""Speculative decoding: proposers draft tokens, the target verifies them in one pass
(engine.sample.rejection_sampler), the scheduler gives the drafts lookahead KV slots."""

from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer

__all__ = ["NgramProposer", "SpeculativeConfig"]
