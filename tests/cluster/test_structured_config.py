"""`--structured-outputs-config` (cluster.http.structured_config): vLLM's field names, a clear
error for any other key, and the reading of schemas it sets, checked on the request params
and through the ingress's HTTP server with a real engine (a lenient server lets the model
write a key the schema does not list; a strict one does not)."""

from __future__ import annotations

import dataclasses

import pytest
import requests

from cluster.http.structured_config import StructuredOutputsConfig
from engine.errors import ParameterError
from tests.cluster.ingress_harness import make_ingress, serve_ingress

NAME = "m"
# One listed key and nothing said of others: the two readings differ only after `{"a": 1`.
SCHEMA = {"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"]}


@pytest.mark.parametrize("value, strict", [
    (None, True), ("{}", True), ('{"backend": "xgrammar"}', True), ({"backend": "guidance"}, False),
    ('{"backend": "guidance", "disable_additional_properties": true}', True),
    ({"backend": "auto", "disable_additional_properties": True}, True),
])
def test_only_guidance_reads_schemas_leniently(value, strict):
    assert StructuredOutputsConfig.of(value).strict_schemas is strict


@pytest.mark.parametrize("value, needle", [
    ('{"backend": "guidance", "disable_additionl_properties": true}',
     "structured_outputs_config has no field 'disable_additionl_properties'; its fields are backend, "
     "disable_additional_properties"),
    ('{"backend": "outlines"}', "structured_outputs_config.backend must be one of"),
    ('{"disable_any_whitespace": true}', "structured_outputs_config.disable_any_whitespace is not supported"),
    ('{"disable_additional_properties": "yes"}', "disable_additional_properties must be true or false"),
    ("backend=guidance", "structured_outputs_config must be a JSON object"),
    ("[]", "structured_outputs_config must be a JSON object"),
])
def test_bad_configs_name_the_field(value, needle):
    with pytest.raises(ParameterError) as e:
        StructuredOutputsConfig.of(value)
    assert needle in str(e.value)


def test_a_lenient_server_keeps_tool_and_response_format_schemas_as_given():
    from cluster.http.protocol import ChatCompletionRequest
    from cluster.http.tools import ToolPlan

    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    body = ChatCompletionRequest(model=NAME, messages=[{"role": "user", "content": "hi"}], response_format=rf)
    assert body.sampling_params(strict_schemas=False).structured_outputs.json == SCHEMA
    assert body.sampling_params().structured_outputs.json == {**SCHEMA, "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]
    named = {"type": "function", "function": {"name": "f"}}
    assert ToolPlan.of(tools, named, None, None, False, strict_schemas=False).constraint().json == SCHEMA
    assert ToolPlan.of(tools, named, None, None, False).constraint().json["additionalProperties"] is False


@pytest.fixture(scope="module")
def server(tiny_model):
    from engine import AsyncLLM, EngineArgs

    engine = AsyncLLM.from_engine_args(EngineArgs(tiny_model, max_model_len=256))
    s = serve_ingress(make_ingress(tiny_model, name=NAME, engines=engine))
    yield s
    s.stop()
    engine.shutdown()


def test_the_server_wide_reading_decides_whether_another_key_may_follow(server):
    """The comma that would open a second key is pushed up by logit_bias: only a lenient
    reading lets the model write it."""
    comma = server.ingress.served.tokenizer.encode(",", add_special_tokens=False)
    assert len(comma) == 1
    body = {"model": NAME, "messages": [{"role": "user", "content": "json"}], "max_tokens": 12, "temperature": 0,
            "logit_bias": {str(comma[0]): 100},
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
    strict = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert strict["choices"][0]["message"]["content"] == '{"a": 1}'
    served = server.ingress.served
    lenient = StructuredOutputsConfig.of('{"backend": "guidance"}')
    server.ingress.served = dataclasses.replace(served, strict_schemas=lenient.strict_schemas)
    try:
        text = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()[
            "choices"][0]["message"]["content"]
    finally:
        server.ingress.served = served
    assert text.startswith('{"a": 1,'), text
