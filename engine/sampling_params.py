"""Per-request sampling parameters, validated the way vLLM's users expect."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import ParameterError, check_number
from engine.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
_INT32_MAX = 2**31 - 1
# Parallel samples per request (engine.parallel_sampling fans them out as separate requests).
MAX_N = 128
# Tokens a request generates when it does not say (vLLM's and OpenAI completions' default). The
# offline API and the CLIs built on it take this one; an HTTP chat or Responses request instead
# gets the room left in the context (max_tokens=None, resolved by engine.processor).
DEFAULT_MAX_TOKENS = 16


@dataclass
class SamplingParams:
    """How to sample one request's completion.

    `temperature=0` is greedy. `top_k` of 0 or -1 disables top-k. `stop` strings are cut
    from the returned text; `stop_token_ids` and EOS tokens are kept in `token_ids` but not
    in the text. Every field is validated on construction and the error names the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = DEFAULT_MAX_TOKENS  # None: the room left in the context
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # Per prompt token after the first: its logprob given the prefix, rank and the top-k.
    prompt_logprobs: int | None = None
    # Penalties (vLLM's names and meanings): presence and frequency over the generated tokens
    # (OpenAI's), repetition over prompt and output (HF's: divides a positive logit, multiplies
    # a negative one).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # token id -> added to its logit (OpenAI's range, [-100, 100]).
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # Words never generated: a word's last token is banned where its earlier tokens were just
    # generated (a one-token word always). Tokenized by the engine (_bad_words_token_ids).
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrain the output to a JSON schema / regex / choice / grammar (engine.structured_output).
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine from the model's generation config; not a user field.
    _eos_token_ids: tuple[int, ...] = field(default=(), repr=False)
    # Filled by the engine from bad_words: each word's token ids, with and without a leading space.
    _bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise ParameterError("n", f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ParameterError("temperature", f"temperature must be >= 0, got {self.temperature}")
        check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ParameterError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not 0 <= self.top_k <= _INT32_MAX:
            raise ParameterError("top_k", f"top_k must be -1, 0 (disabled) or a positive integer <= {_INT32_MAX}, "
                             f"got {self.top_k!r}")
        check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ParameterError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -(2**63) <= self.seed < 2**63):
            # torch generators take 64-bit seeds; a larger one would fail inside the engine step.
            raise ParameterError("seed", f"seed must be an integer in [-2**63, 2**63) or None, got {self.seed!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ParameterError("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ParameterError("min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParameterError(
                "min_tokens", f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ParameterError("stop", f"stop must be a non-empty string or a list of them, got {s!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise ParameterError("stop_token_ids", f"stop_token_ids must be non-negative integers, got {t!r}")
        # The upper bound is the engine's max_logprobs (engine.processor checks it).
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ParameterError(name, f"{name} must be None or an integer >= 0, got {value!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            check_number(name, getattr(self, name))
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ParameterError(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        check_number("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise ParameterError("repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        self._validate_token_lists()
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ParameterError("structured_outputs", "structured_outputs must be StructuredOutputsParams, "
                                 f"got {type(self.structured_outputs).__name__}")

    def _validate_token_lists(self) -> None:
        """logit_bias, allowed_token_ids and bad_words; token ids against the vocabulary are
        the engine's check (engine.processor), which knows its size."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ParameterError("logit_bias", f"logit_bias must map token ids to biases, got {self.logit_bias!r}")
            for tok, bias in self.logit_bias.items():
                if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                    raise ParameterError("logit_bias", f"logit_bias keys must be token ids (integers >= 0), got {tok!r}")
                check_number("logit_bias", bias)
                if not -100.0 <= bias <= 100.0:
                    raise ParameterError("logit_bias", f"logit_bias values must be in [-100, 100], got {bias} "
                                         f"for token {tok}")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ParameterError("allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids, "
                                     f"got {ids!r}")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not isinstance(self.bad_words, (list, tuple)):
                raise ParameterError("bad_words", f"bad_words must be a list of strings, got {self.bad_words!r}")
            for w in self.bad_words:
                if not isinstance(w, str) or not w.strip():
                    raise ParameterError("bad_words", f"bad_words entries must be non-empty strings, got {w!r}")
            self.bad_words = list(self.bad_words)

    @property
    def penalized(self) -> bool:
        """Whether a penalty, bias or allowed list changes this request's logits (bad words
        are bans, applied with min_tokens')."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.allowed_token_ids is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        eos = set() if self.ignore_eos else set(self._eos_token_ids)
        return eos | set(self.stop_token_ids)

