"""A request's structured-output state: its constraint and the matcher compiled for it."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from engine.structured_output.backend import StructuredOutputGrammar
from engine.structured_output.params import StructuredOutputsParams


@dataclass
class StructuredOutputRequest:
    params: StructuredOutputsParams
    # Resolves to the request's own matcher, already past any tokens sampled elsewhere
    # (a P/D decode request's first token), or raises the compile error.
    grammar_future: Future | None = field(default=None, repr=False)

    @property
    def ready(self) -> bool:
        return self.grammar_future is not None and self.grammar_future.done()

    @property
    def grammar(self) -> StructuredOutputGrammar | None:
        """The matcher once compiled (None before, or if compiling failed)."""
        if not self.ready or self.grammar_future.exception() is not None:
            return None
        return self.grammar_future.result()

    @property
    def compile_error(self) -> str | None:
        if not self.ready:
            return None
        e = self.grammar_future.exception()
        return None if e is None else str(e)
