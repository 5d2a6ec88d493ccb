"""vLLM's `--structured-outputs-config` (its StructuredOutputsConfig, by its field names): how
the server reads the JSON schemas of `response_format` and of forced tool calls.

pdserve's grammars always run on llguidance; what `backend` chooses is the reading of a schema
that says nothing of `additionalProperties`, as vLLM's backends differ there:
- `auto` (the default) and `xgrammar`: strict, as xgrammar reads it (vLLM's usual choice): an
  object schema that lists `properties` allows no other key (cluster.http.strict_schema);
- `guidance`: JSON Schema's own reading (any other key allowed), as vLLM's guidance backend
  reads it, unless `disable_additional_properties` is true, which makes it strict again.

Why a server-wide switch beside the per-request `"strict": false`: clients that cannot send
that field (tool schemas, agent frameworks) and schemas written for lenient servers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from engine.errors import ParameterError, check_choice

FIELD = "structured_outputs_config"
BACKENDS = ("auto", "xgrammar", "guidance")
# vLLM's other StructuredOutputsConfig fields: said to be unsupported by name, not "unknown".
_VLLM_ONLY = {
    "disable_fallback": "there is one backend, so nothing to fall back to",
    "disable_any_whitespace": "JSON output is always compact here",
    "reasoning_parser": "use --reasoning-parser",
    "reasoning_parser_plugin": "reasoning parsers are built in (--reasoning-parser)",
    "enable_in_reasoning": "a reasoning model's grammar starts after its thinking",
}


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        check_choice(f"{FIELD}.backend", self.backend, BACKENDS)
        if not isinstance(self.disable_additional_properties, bool):
            raise ParameterError(FIELD, f"{FIELD}.disable_additional_properties must be true or false, "
                                 f"got {self.disable_additional_properties!r}")

    @property
    def strict_schemas(self) -> bool:
        """Whether an object schema without `additionalProperties` allows no other key."""
        return self.backend != "guidance" or self.disable_additional_properties

    @classmethod
    def of(cls, value: str | dict | StructuredOutputsConfig | None) -> StructuredOutputsConfig:
        """The config from the flag's JSON text, a dict of its fields (a Serve config), or
        None (the defaults); ParameterError naming the field that is wrong."""
        if value is None or isinstance(value, cls):
            return value or cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ParameterError(FIELD, f"{FIELD} must be a JSON object, got {value!r} ({e})") from None
        if not isinstance(value, dict):
            raise ParameterError(FIELD, f"{FIELD} must be a JSON object, got {type(value).__name__}")
        known = tuple(f.name for f in fields(cls))
        for key in value:
            if key in _VLLM_ONLY:
                raise ParameterError(FIELD, f"{FIELD}.{key} is not supported: {_VLLM_ONLY[key]}")
            if key not in known:
                raise ParameterError(FIELD, f"{FIELD} has no field {key!r}; its fields are {', '.join(known)}")
        return cls(**value)
