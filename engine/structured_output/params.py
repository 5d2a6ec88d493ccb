"""What a request asks its output to match: one JSON schema, regex, choice list, Lark grammar
or "any JSON object" (vLLM's `StructuredOutputsParams`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from engine.errors import ParameterError

_FIELD = "structured_outputs"
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the constraints is set.

    `json` is a JSON schema (a dict, or its JSON text); `regex` must match the whole output;
    `choice` lists the only outputs allowed; `grammar` is a Lark grammar (llguidance's
    dialect, `start` is the start rule); `json_object=True` allows any JSON object.
    Shape is checked here; whether the schema/regex/grammar compiles is checked by the
    backend when the request is submitted (engine.structured_output.validate).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # The constraint starts after these output tokens (a reasoning model's `</think>`, set by the
    # server's reasoning parser, as vLLM starts its grammar after the reasoning): tokens before
    # them and they themselves are free. None: from the first output token.
    after_tokens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        set_ = [f.name for f in fields(self) if f.name in _KINDS and getattr(self, f.name) not in (None, False)]
        if len(set_) != 1:
            raise ParameterError(_FIELD, "structured_outputs must set exactly one of "
                                 f"{', '.join(_KINDS)}; got {set_ or 'none'}")
        if self.json is not None:
            self._check_json()
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ParameterError(_FIELD, f"structured_outputs.regex must be a non-empty string, got {self.regex!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ParameterError(_FIELD, "structured_outputs.grammar must be a non-empty Lark grammar")
        if self.choice is not None:
            choice = self.choice
            if (not isinstance(choice, (list, tuple)) or not choice
                    or not all(isinstance(c, str) and c for c in choice)):
                raise ParameterError(_FIELD, "structured_outputs.choice must be a non-empty list of "
                                     f"non-empty strings, got {choice!r}")
            # Frozen means frozen: a caller's list cannot change the request after the fact.
            object.__setattr__(self, "choice", tuple(choice))
        if self.after_tokens is not None:
            after = self.after_tokens
            if (not isinstance(after, (list, tuple)) or not after
                    or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in after)):
                raise ParameterError(_FIELD, f"structured_outputs.after_tokens must be token ids, got {after!r}")
            object.__setattr__(self, "after_tokens", tuple(after))
        if self.json_object is not None and self.json_object is not True:
            raise ParameterError(_FIELD, f"structured_outputs.json_object must be true, got {self.json_object!r}")

    def _check_json(self) -> None:
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ParameterError(_FIELD, f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ParameterError(_FIELD, "structured_outputs.json must be a JSON schema (an object), "
                                 f"got {type(schema).__name__}")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text, canonical for JSON (key order does not matter)."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            return json.dumps(schema, sort_keys=True, separators=(",", ":"))
        if self.kind == "choice":
            return json.dumps(list(value))
        return "" if self.kind == "json_object" else value

    @property
    def cache_key(self) -> tuple[str, str]:
        """Requests with equal keys share one compiled grammar."""
        return self.kind, self.spec
