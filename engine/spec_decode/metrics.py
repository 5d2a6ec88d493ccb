"""Cumulative acceptance counters of speculative decoding (vLLM's spec_decode metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_speculative_tokens: int
    num_drafts: int = 0  # verification steps of one request with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [k] how often the draft at each position was accepted (a draft is only accepted when
    # every draft before it was, so this is non-increasing).
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step: accepted drafts plus the one the target adds."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
