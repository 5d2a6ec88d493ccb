"""StructuredOutputsParams and submit-time validation: every bad constraint is a ValueError
(a ParameterError naming `structured_outputs`) before anything is queued."""

from __future__ import annotations

import pytest

from engine import ParameterError, SamplingParams, StructuredOutputsParams
from engine import structured_output as so


@pytest.mark.parametrize("kwargs", [
    {},
    dict(json={"type": "object"}, regex="a+"),
    dict(choice=["a"], grammar="start: \"a\""),
    dict(choice=[]),
    dict(choice=["a", 3]),
    dict(json="{not json"),
    dict(json=[1, 2]),
    dict(regex=""),
    dict(json_object=False),
])
def test_malformed_structured_outputs_name_the_field(kwargs):
    with pytest.raises(ParameterError) as e:
        StructuredOutputsParams(**kwargs)
    assert e.value.field == "structured_outputs"


def test_structured_outputs_must_be_the_params_type():
    with pytest.raises(ParameterError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})


def test_choice_list_is_copied_so_the_caller_cannot_change_it():
    choices = ["a", "b"]
    params = StructuredOutputsParams(choice=choices)
    choices.append("c")
    assert params.choice == ("a", "b")


def test_equal_json_schemas_share_a_cache_key_whatever_their_key_order():
    a = StructuredOutputsParams(json={"type": "object", "required": ["x"]})
    b = StructuredOutputsParams(json='{"required": ["x"], "type": "object"}')
    assert a.cache_key == b.cache_key
    assert a.cache_key != StructuredOutputsParams(json={"type": "array"}).cache_key


@pytest.mark.parametrize("kwargs", [
    dict(regex="a(b"),
    dict(json={"type": "foo"}),
    dict(json={"type": "string", "format": "no-such-format"}),
    dict(grammar="start: undefined_rule"),
])
def test_specs_that_cannot_compile_are_rejected_by_validate(kwargs):
    with pytest.raises(ParameterError) as e:
        so.validate(StructuredOutputsParams(**kwargs))
    assert e.value.field == "structured_outputs"


def test_valid_specs_pass_validate():
    for kwargs in (dict(regex="a+"), dict(json={"type": "object"}), dict(choice=["x"]),
                   dict(grammar='start: "a"'), dict(json_object=True)):
        so.validate(StructuredOutputsParams(**kwargs))
