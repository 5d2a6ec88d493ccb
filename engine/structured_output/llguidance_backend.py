"""The llguidance backend: JSON schema, regex, choice and Lark grammars, with parallel batch
mask filling in Rust (its LLExecutor)."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import numpy as np
from llguidance import LLExecutor, LLMatcher

from engine.errors import ParameterError
from engine.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar
from engine.structured_output.params import StructuredOutputsParams

# Compact JSON: no free whitespace between tokens. A model left to choose would spend its
# budget on blanks (random-weight models do, small real ones often do), and compact output is
# what json.dumps writes anyway.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(params: StructuredOutputsParams) -> str:
    """`params` in llguidance's grammar format."""
    kind = params.kind
    if kind == "json":
        schema = json.loads(params.json) if isinstance(params.json, str) else params.json
        return LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        # A Lark string literal takes JSON's escapes.
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    return LLMatcher.grammar_from_lark(params.grammar)


class GuidanceGrammar(StructuredOutputGrammar):
    def __init__(self, matcher: LLMatcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, tokens: list[int]) -> bool:
        return self.matcher.consume_tokens(tokens)

    def fill_bitmask(self, bitmask: np.ndarray, index: int) -> None:
        row = bitmask[index]
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def copy(self) -> GuidanceGrammar:
        return GuidanceGrammar(self.matcher.deep_copy())

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    @property
    def terminated(self) -> bool:
        return self.matcher.is_stopped()


class GuidanceBackend(StructuredOutputBackend):
    name = "guidance"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        # n_vocab = the model's width, so mask rows line up with the logits.
        self.ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
        self.executor = LLExecutor()

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        try:
            message = LLMatcher.validate_grammar(grammar_text(params))
        except ValueError as e:
            message = str(e)
        if message:
            raise ParameterError("structured_outputs", f"structured_outputs.{params.kind} is invalid: {message}")

    def compile(self, params: StructuredOutputsParams) -> GuidanceGrammar:
        matcher = LLMatcher(self.ll_tokenizer, grammar_text(params), log_level=0)
        if matcher.is_error():
            raise ParameterError("structured_outputs",
                                 f"structured_outputs.{params.kind} is invalid: {matcher.get_error()}")
        return GuidanceGrammar(matcher)

    def fill_bitmasks(self, rows: list[tuple[StructuredOutputGrammar, int]], bitmask: np.ndarray) -> None:
        assert bitmask.dtype == np.int32 and bitmask.flags["C_CONTIGUOUS"]
        pairs = [(g.matcher, index) for g, index in rows]
        self.executor.unsafe_compute_mask_ptr(pairs, bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0])
