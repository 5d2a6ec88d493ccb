"""The structured-output fields of a chat or completions body that are not vLLM's own
`structured_outputs`: OpenAI's `response_format` and vLLM's legacy `guided_*` fields, as
StructuredOutputsParams (cluster.http.protocol picks which one a body uses)."""

from __future__ import annotations

from cluster.http.strict_schema import strict
from engine.errors import ParameterError
from engine.structured_output import StructuredOutputsParams

# vLLM's legacy guided-decoding fields and the StructuredOutputsParams field each maps to.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def response_format_params(rf: dict, strict_schemas: bool = True) -> StructuredOutputsParams:
    """OpenAI's response_format: {"type": "json_object"} or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}. `strict_schemas`: the server's reading
    (--structured-outputs-config, cluster.http.structured_config)."""
    kind = rf.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise ParameterError("response_format", "response_format.type must be 'text', 'json_object' or "
                             f"'json_schema', got {kind!r}")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ParameterError("response_format", "response_format.json_schema.schema must be a JSON schema object")
    # Read strictly, as vLLM's default grammar backend reads it (cluster.http.strict_schema),
    # unless the request says `"strict": false` or the server reads schemas leniently: then as
    # JSON Schema itself reads it.
    lenient = spec.get("strict") is False or not strict_schemas
    schema = spec["schema"] if lenient else strict(spec["schema"])
    return StructuredOutputsParams(json=schema)
