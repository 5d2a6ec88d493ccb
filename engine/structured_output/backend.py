"""The contract between the engine and a grammar library.

The engine only sees int32 token bitmasks in the shared layout: row i, word w, bit b allows
token 32*w + b (llguidance and xgrammar both fill this layout), so a second backend plugs in
without touching the scheduler or the sampler.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from engine.structured_output.params import StructuredOutputsParams


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32

# How a request that its grammar ended starts its stop_reason (finish_reason "error"): the
# serving layer answers it as the request's fault (no token satisfied every constraint).
GRAMMAR_FAILURE = "grammar: "


class StructuredOutputGrammar(ABC):
    """One request's matcher: where in the grammar its tokens so far have led."""

    @abstractmethod
    def accept_tokens(self, tokens: list[int]) -> bool:
        """Advance past `tokens`; False if one of them is not allowed (the matcher is then
        in an error state and the request cannot continue)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, index: int) -> None:
        """Write the allowed next tokens into row `index` of `bitmask` [rows, words] int32."""

    @abstractmethod
    def copy(self) -> StructuredOutputGrammar:
        """An independent matcher in the same state (a compiled template -> a request's)."""

    @property
    @abstractmethod
    def error(self) -> str:
        """Why the matcher is in an error state; empty when it is not."""

    @property
    def terminated(self) -> bool:
        """Whether the grammar has ended (it took its end-of-sequence): no token may follow."""
        return False


class StructuredOutputBackend(ABC):
    """Compiles constraints against one tokenizer and fills batch bitmasks."""

    name: str

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        """`vocab_size` is the model's (the logits' width); it may exceed the tokenizer's,
        and the extra ids are never allowed."""
        self.vocab_size = vocab_size

    @staticmethod
    @abstractmethod
    def validate(params: StructuredOutputsParams) -> None:
        """Raise ParameterError if `params` cannot compile; cheap, needs no tokenizer, so the
        front end checks a request before it is queued."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """A matcher at the start of the grammar (slow: runs off the engine thread)."""

    def fill_bitmasks(self, rows: list[tuple[StructuredOutputGrammar, int]], bitmask: np.ndarray) -> None:
        """Fill `bitmask[index]` for each (grammar, index)."""
        for grammar, index in rows:
            grammar.fill_bitmask(bitmask, index)
