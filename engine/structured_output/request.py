"""A request's structured-output state: its constraint and the matcher compiled for it."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from engine.structured_output.backend import GRAMMAR_FAILURE, StructuredOutputGrammar
from engine.structured_output.params import StructuredOutputsParams


def split_after(tokens: list[int], after: tuple[int, ...] | None) -> tuple[bool, list[int]]:
    """(still before the constraint starts, the tokens the matcher takes) of output tokens
    `tokens` under `after_tokens` (engine.structured_output.params)."""
    if not after:
        return False, list(tokens)
    n = len(after)
    for i in range(len(tokens) - n + 1):
        if tuple(tokens[i:i + n]) == after:
            return False, list(tokens[i + n:])
    return True, []


@dataclass
class StructuredOutputRequest:
    params: StructuredOutputsParams
    # Resolves to the request's own matcher, already past any tokens sampled elsewhere
    # (a P/D decode request's first token), or raises the compile error.
    grammar_future: Future | None = field(default=None, repr=False)
    # Before the constraint starts (params.after_tokens not yet in the output): no mask, and
    # the matcher takes nothing. `_tail`: the last output tokens, to see them arrive.
    before_start: bool = False
    _tail: list[int] = field(default_factory=list, repr=False)

    @property
    def ready(self) -> bool:
        return self.grammar_future is not None and self.grammar_future.done()

    @property
    def grammar(self) -> StructuredOutputGrammar | None:
        """The matcher once compiled (None before, or if compiling failed)."""
        if not self.ready or self.grammar_future.exception() is not None:
            return None
        return self.grammar_future.result()

    def advance(self, token: int, eos_token_ids) -> str | None:
        """Take the request's next token: None, or why the grammar refuses it (sampled outside
        the mask: no token satisfied every constraint of the request, e.g. the grammar and
        allowed_token_ids share none). A complete grammar allows EOS alone, without
        consuming it."""
        if self.before_start:
            after = self.params.after_tokens
            self._tail = (self._tail + [token])[-len(after):]
            self.before_start = tuple(self._tail) != after
            return None
        grammar = self.grammar
        if grammar.terminated:
            return None if token in eos_token_ids else f"{GRAMMAR_FAILURE}the grammar is complete; only EOS may follow"
        return None if grammar.accept_tokens([token]) else f"{GRAMMAR_FAILURE}{grammar.error}"

    def complete(self, request) -> bool:
        """Whether the request must stop with its grammar complete: it is, while min_tokens
        still bans EOS, the one token the grammar allows (the sampler lifts such a ban rather
        than leave nothing to sample). Otherwise EOS, the grammar's last token, stops it, as
        in vLLM."""
        return (not self.before_start and request.num_output_tokens < request.sampling_params.min_tokens
                and self.grammar.terminated)

    @property
    def compile_error(self) -> str | None:
        """Why the grammar did not compile (a stop_reason, as `advance`'s failures), or None."""
        if not self.ready:
            return None
        e = self.grammar_future.exception()
        return None if e is None else f"{GRAMMAR_FAILURE}{e}"
