"""cluster.http.protocol's structured-output fields: vLLM's `structured_outputs`, OpenAI's
`response_format` and the legacy `guided_*` all become one StructuredOutputsParams, and an
error's `param` is the field the client actually sent."""

from __future__ import annotations

import pytest

from cluster.http.protocol import ChatCompletionRequest, CompletionRequest
from engine import StructuredOutputsParams
from engine.errors import ParameterError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
MSG = [{"role": "user", "content": "hi"}]


def _both(**kw):
    return [CompletionRequest(model="m", prompt="p", **kw), ChatCompletionRequest(model="m", messages=MSG, **kw)]


@pytest.mark.parametrize("kw, expected", [
    (dict(structured_outputs={"regex": "a+"}), StructuredOutputsParams(regex="a+")),
    (dict(response_format={"type": "json_object"}), StructuredOutputsParams(json_object=True)),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": False}}),
     StructuredOutputsParams(json=SCHEMA)),
    (dict(guided_json=SCHEMA), StructuredOutputsParams(json=SCHEMA)),
    (dict(guided_regex="[0-9]+"), StructuredOutputsParams(regex="[0-9]+")),
    (dict(guided_choice=["a", "b"]), StructuredOutputsParams(choice=["a", "b"])),
    (dict(guided_grammar='start: "x"'), StructuredOutputsParams(grammar='start: "x"')),
])
def test_every_spelling_maps_to_the_same_params(kw, expected):
    for body in _both(**kw):
        assert body.sampling_params().structured_outputs == expected


def test_a_json_schema_response_format_is_strict_unless_it_says_strict_false():
    """vLLM's default grammar backend reads unspecified additionalProperties as false."""
    from cluster.http.strict_schema import strict

    def params(flag):
        spec = {"name": "x", "schema": SCHEMA, **({} if flag is None else {"strict": flag})}
        return ChatCompletionRequest(model="m", messages=MSG, response_format={"type": "json_schema", "json_schema": spec}
                                     ).sampling_params().structured_outputs.json

    assert params(None) == params(True) == strict(SCHEMA) == {**SCHEMA, "additionalProperties": False}
    assert params(False) == SCHEMA


def test_text_response_format_is_no_constraint():
    for body in _both(response_format={"type": "text"}):
        assert body.sampling_params().structured_outputs is None


@pytest.mark.parametrize("kw, param", [
    (dict(guided_json=SCHEMA, guided_regex="a"), "guided_regex"),
    (dict(response_format={"type": "json_object"}, guided_choice=["a"]), "guided_choice"),
    (dict(guided_choice=[]), "guided_choice"),
    (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs"),
    (dict(structured_outputs={"pattern": "a"}), "structured_outputs"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
    (dict(response_format={"type": "xml"}), "response_format"),
])
def test_bad_or_conflicting_specs_name_the_field_sent(kw, param):
    for body in _both(**kw):
        with pytest.raises(ParameterError) as e:
            body.sampling_params()
        assert body.param(e.value.field) == param


def test_an_engine_side_compile_error_maps_to_the_field_sent():
    for body in _both(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}):
        assert body.param("structured_outputs") == "response_format"
    for body in _both(guided_regex="a("):
        assert body.param("structured_outputs") == "guided_regex"
