"""Incremental detokenization and stop-string matching."""

from __future__ import annotations

# How many prompt tokens are kept as decoding context for the first output tokens (enough for
# tokenizers that decide spacing from the previous token).
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas.

    Each step decodes tokens[prefix:] and tokens[prefix:read] and emits the difference. A
    delta ending in U+FFFD means the last token ended mid-character (its UTF-8 bytes continue
    in the next token): nothing is emitted until the character is complete.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        # Fast tokenizers expose their Rust backend: decoding through it directly skips
        # transformers' per-call Python conversions (several times faster per token).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str:
        self.tokens.append(token_id)
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return delta

    def flush(self) -> str:
        """At the end of the request: whatever is still held back (a character whose bytes
        never completed decodes to U+FFFD, as `tokenizer.decode` of all tokens would show;
        holding it would also drop the complete characters decoded with it)."""
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.tokens)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> tuple[str, int] | None:
    """The first stop string that ends inside the last `num_new_chars` characters of `text`,
    with its start index; earlier text was already checked."""
    best: tuple[str, int] | None = None
    for s in stops:
        start = max(0, len(text) - num_new_chars - len(s) + 1)
        idx = text.find(s, start)
        if idx != -1 and (best is None or idx < best[1]):
            best = (s, idx)
    return best
