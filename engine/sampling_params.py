"""Per-request sampling parameters, validated the way vLLM's users expect."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import ParameterError, check_number
from engine.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
_INT32_MAX = 2**31 - 1
# Parallel samples per request (engine.parallel_sampling fans them out as separate requests).
MAX_N = 128


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
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrain the output to a JSON schema / regex / choice / grammar (engine.structured_output).
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine from the model's generation config; not a user field.
    _eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

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
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20
        ):
            raise ParameterError("logprobs", f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ParameterError("structured_outputs", "structured_outputs must be StructuredOutputsParams, "
                                 f"got {type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        eos = set() if self.ignore_eos else set(self._eos_token_ids)
        return eos | set(self.stop_token_ids)

