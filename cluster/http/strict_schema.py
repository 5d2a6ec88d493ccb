"""Tool arguments' schemas made strict, as vLLM's default grammar backend (xgrammar, strict
mode) reads them: an object schema that lists its `properties` and says nothing of
`additionalProperties` allows no other keys.

Why: JSON Schema's own default allows any other key, so a grammar built from a tool's bare
schema lets a small model append keys until max_tokens (measured on the default model: a
forced call ran to 96 tokens and ended with finish_reason "length" and no tool call). What a
schema states itself is kept; a copy is changed, never the request's dict.
"""

from __future__ import annotations

# Keywords whose value is one schema, a list of schemas, or a mapping of names to schemas.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict(schema):
    """A copy of `schema` in which every object schema with `properties` and no
    `additionalProperties` (or `unevaluatedProperties`) has `additionalProperties: false`."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _ONE:
        if isinstance(out.get(k), dict):
            out[k] = strict(out[k])
    for k in _LIST:
        if isinstance(out.get(k), list):
            out[k] = [strict(s) for s in out[k]]
    for k in _MAP:
        if isinstance(out.get(k), dict):
            out[k] = {name: strict(s) for name, s in out[k].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = strict(out["additionalProperties"])
    if "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out
