"""cluster.http.tools: the request's tools and tool_choice as a plan, checked against OpenAI's
rules and jsonschema (the constraint's schemas accept exactly the calls they should)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cluster.http.tool_parsers import HermesToolParser
from cluster.http.tools import ToolPlan, parse_tools, plain_conversation
from engine.errors import ParameterError

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _plan(choice="auto", tools=(WEATHER, TIME), parallel=None, auto=True):
    return ToolPlan.of(list(tools), choice, parallel, HermesToolParser, auto)


@pytest.mark.parametrize("tools, match", [
    ([{"type": "function", "function": {"description": "no name"}}], r"tools\[0\]\.function\.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}], "JSON schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": "object"}}], "JSON schema"),
    ([{"type": "retrieval"}], r"tools\[0\]"),
    ([WEATHER, WEATHER], "unique"),
])
def test_malformed_tools_name_the_field(tools, match):
    with pytest.raises(ParameterError, match=match) as e:
        parse_tools(tools)
    assert e.value.field == "tools"


@pytest.mark.parametrize("choice, auto, match", [
    ({"type": "function", "function": {"name": "nope"}}, True, "not among the tools"),
    ({"type": "function"}, True, "tool_choice must be"),
    ("sometimes", True, "tool_choice must be"),
    ("auto", False, "--enable-auto-tool-choice"),
])
def test_bad_tool_choice_names_the_field(choice, auto, match):
    with pytest.raises(ParameterError, match=match) as e:
        _plan(choice, auto=auto)
    assert e.value.field == "tool_choice"


def test_no_tools_means_no_plan_and_a_forcing_choice_without_tools_is_refused():
    assert ToolPlan.of(None, None, None, None, False) is None
    assert ToolPlan.of([], "none", None, None, False) is None
    with pytest.raises(ParameterError, match="requires tools"):
        ToolPlan.of(None, "required", None, None, False)


def test_none_hides_the_tools_and_forcing_modes_constrain():
    assert _plan("none").template_tools() is None and _plan("none").constraint() is None
    assert _plan("auto").constraint() is None
    assert [t["function"]["name"] for t in _plan("auto").template_tools()] == ["get_weather", "get_time"]
    named = _plan({"type": "function", "function": {"name": "get_weather"}}).constraint()
    assert named.json == WEATHER["function"]["parameters"]


def test_required_schema_accepts_exactly_calls_of_offered_tools():
    schema = _plan("required").constraint().json
    ok = [[{"name": "get_weather", "parameters": {"city": "Paris"}}],
          [{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}, {"name": "get_time", "parameters": {}}]]
    bad = [[], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}],
           [{"name": "get_weather", "parameters": {"city": 3}}], {"name": "get_time", "parameters": {}}]
    for x in ok:
        jsonschema.validate(x, schema)
    for x in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(x, schema)
    single = _plan("required", parallel=False).constraint().json
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok[1], single)


def test_whole_parse_per_mode():
    content, calls = _plan("required").parse(json.dumps([{"name": "get_time", "parameters": {}},
                                                         {"name": "get_weather", "parameters": {"city": "Rome"}}]))
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {}), ("get_weather", {"city": "Rome"})]
    assert len({c.id for c in calls}) == 2
    content, calls = _plan({"type": "function", "function": {"name": "get_weather"}}).parse('{"city": "Rome"}')
    assert content is None and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Rome"}
    content, calls = _plan("auto").parse('Sure. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert content == "Sure." and calls[0].name == "get_time"
    assert _plan("none").parse("just text") == ("just text", [])
    # A required answer cut by max_tokens is not a call: the text comes back as content.
    assert _plan("required").parse('[{"name": "get_ti') == ('[{"name": "get_ti', [])


def test_finish_reasons():
    plan = _plan("auto")
    assert plan.finish_reason(["call"], "stop") == "tool_calls"
    assert plan.finish_reason([], "stop") == "stop"
    assert plan.finish_reason(["call"], "length") == "length"
    assert _plan({"type": "function", "function": {"name": "get_time"}}).finish_reason(["call"], "stop") == "stop"


def _assemble(deltas):
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            entry = calls.setdefault(c["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in c:
                assert entry["id"] is None and c["type"] == "function"
                entry["id"] = c["id"]
            fn = c.get("function", {})
            entry["name"] = fn.get("name", entry["name"])
            entry["arguments"] += fn.get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("choice, text", [
    ("required", json.dumps([{"name": "get_weather", "parameters": {"city": "Lima"}},
                             {"name": "get_time", "parameters": {}}])),
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Lima", "days": 3}'),
    ("auto", 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}</tool_call>'),
    ("none", "No tools today."),
])
def test_streamed_deltas_assemble_to_the_whole_parse(choice, text):
    plan = _plan(choice)
    streamer = plan.streamer()
    deltas = [d.model_dump() for i in range(0, len(text), 3) for d in streamer.feed(text[i:i + 3])]
    deltas += [d.model_dump() for d in streamer.finish()]
    content, calls = _assemble(deltas)
    want_content, want_calls = plan.parse(text)
    assert content == (want_content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c.name, json.loads(c.arguments)) for c in want_calls]
    assert all(c["id"] for c in calls) and streamer.calls == len(want_calls)


def test_forced_calls_allow_no_keys_a_schema_does_not_list_unless_it_says_so():
    """vLLM's grammar backend reads a bare object schema strictly: a model cannot add keys."""
    city = {"type": "object", "properties": {"city": {"type": "string"},
                                             "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
                                             "tags": {"type": "array", "items": {"type": "object",
                                                                                 "properties": {"k": {}}}}},
            "required": ["city"]}
    loose = {"type": "object", "properties": {"x": {}}, "additionalProperties": True}
    tools = [{"type": "function", "function": {"name": "f", "parameters": city}},
             {"type": "function", "function": {"name": "g", "parameters": loose}}]
    named = _plan({"type": "function", "function": {"name": "f"}}, tools).constraint().json
    jsonschema.validate({"city": "Paris", "where": {"lat": 1.5}, "tags": [{"k": 1}]}, named)
    for extra in ({"city": "Paris", "country": "France"}, {"city": "P", "where": {"lat": 1, "lon": 2}},
                  {"city": "P", "tags": [{"k": 1, "v": 2}]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(extra, named)
    assert "additionalProperties" not in city  # the request's own schema is untouched
    required = _plan("required", tools).constraint().json
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"city": "P", "more": 1}}], required)
    jsonschema.validate([{"name": "g", "parameters": {"x": 1, "y": 2}}], required)  # it said so


def test_a_template_without_tools_gets_each_turns_results_as_one_user_turn_of_tool_responses():
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}
    conv = [{"role": "user", "content": "q"}, call,
            {"role": "tool", "tool_call_id": "1", "content": "a"},
            {"role": "tool", "tool_call_id": "2", "content": [{"type": "text", "text": "b"}]},
            call, {"role": "tool", "tool_call_id": "3", "content": "c"}]
    out = plain_conversation(conv, None)
    assert [m["role"] for m in out] == ["user", "assistant", "user", "assistant", "user"]
    assert out[2]["content"] == "<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response>"
    assert out[4] == {"role": "user", "content": "<tool_response>\nc\n</tool_response>"}
    assert out[1]["content"] == '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
