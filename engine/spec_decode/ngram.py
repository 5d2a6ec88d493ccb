"""Prompt-lookup (n-gram) proposer: drafts are what followed an earlier copy of the suffix.

Copy-heavy outputs (rewriting, quoting, code edits, repetitive text) repeat spans of the
prompt or of themselves; when the last n tokens occurred before, the tokens after that
occurrence are a free guess at what comes next. No model runs, so a wrong guess only costs
the verification positions.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, tokens: np.ndarray, max_drafts: int | None = None) -> list[int]:
        """Up to min(k, max_drafts) draft tokens continuing `tokens` ([L] int), or [].

        The longest suffix n-gram (max_n down to min_n) wins; among its earlier occurrences the
        most recent one, whose continuation reflects the latest context.
        """
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        L = len(tokens)
        if k <= 0 or L < self.min_n + 1:
            return []
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix = tokens[L - n:]
            # windows[i] = tokens[i:i+n] for every start i that leaves a token after it.
            windows = sliding_window_view(tokens[: L - 1], n)  # [L - n, n]
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []
