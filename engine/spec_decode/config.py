"""SpeculativeConfig: which proposer drafts tokens and how many (vLLM's field names)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from engine.errors import ParameterError, check_int

METHODS = ("ngram", "draft_model")
_FIELD = "speculative_config"
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`method="ngram"` drafts by prompt lookup: the longest suffix n-gram of the request's
    tokens (prompt_lookup_min <= n <= prompt_lookup_max) found earlier in them proposes the
    tokens that followed it. `method="draft_model"` names a smaller model (`model`) that must
    share the target's vocabulary."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 2
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ParameterError(f"{_FIELD}.method",
                                 f"{_FIELD}.method must be one of {METHODS}, got {self.method!r}")
        check_int(f"{_FIELD}.num_speculative_tokens", self.num_speculative_tokens, 1, 32)
        if self.method == "ngram":
            check_int(f"{_FIELD}.prompt_lookup_min", self.prompt_lookup_min, 1)
            check_int(f"{_FIELD}.prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min)
        else:
            if not isinstance(self.model, str) or not os.path.exists(self.model):
                raise ParameterError(f"{_FIELD}.model", f"{_FIELD}.model must be an existing draft model "
                                     f"directory or .gguf file for method 'draft_model', got {self.model!r}")

    @classmethod
    def from_user(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From EngineArgs: a dict, a JSON object (the CLI flag) or None (no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ParameterError(_FIELD, f"{_FIELD} must be a JSON object, got {value!r} ({e})") from None
        if not isinstance(value, dict):
            raise ParameterError(_FIELD, f"{_FIELD} must be a dict / JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ParameterError(f"{_FIELD}.{unknown[0]}", f"unknown {_FIELD} keys {unknown}; allowed: {list(_KEYS)}")
        if "method" not in value:
            raise ParameterError(f"{_FIELD}.method", f"{_FIELD}.method is required, one of {METHODS}")
        values = dict(value)
        if values["method"] == "ngram":
            # Only one bound given: the other follows it (an n-gram window of one length).
            if "prompt_lookup_max" in values and "prompt_lookup_min" not in values:
                mx = values["prompt_lookup_max"]
                values["prompt_lookup_min"] = min(cls.prompt_lookup_min, mx) if isinstance(mx, int) else mx
            if "prompt_lookup_min" in values and "prompt_lookup_max" not in values:
                mn = values["prompt_lookup_min"]
                values["prompt_lookup_max"] = max(cls.prompt_lookup_max, mn) if isinstance(mn, int) else mn
        return cls(**values)


def check_draft_vocab(target_vocab: int, draft_vocab: int) -> None:
    """A draft model proposes token ids the target must understand: same vocabulary."""
    if target_vocab != draft_vocab:
        raise ParameterError(f"{_FIELD}.model", f"{_FIELD}.model has a vocabulary of {draft_vocab} tokens; "
                             f"the target model has {target_vocab}: the draft must share its tokenizer")
