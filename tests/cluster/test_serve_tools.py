"""Tool calling through the official openai client, in P/D and colocated mode, on the tiny model
whose chat template shows tools (make-model's): forced calls (required, named) validate against
the tools' schemas plain and streamed, a tool result round-trips through the template, "auto"
runs the hermes parser on the model's text, and bad requests are 400s naming the field.

Oracles: jsonschema for the arguments, the HF tokenizer's own template rendering for prompt
token counts, and the plain response for what the streamed deltas assemble to.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import requests

from tests.cluster.helpers import SHARED_NAME, assert_no_leaks

NAME = SHARED_NAME
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                                                "enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris for two days?"}]


def _check_calls(calls):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    assert len({c.id for c in calls}) == len(calls)


def _streamed(client, **kw):
    """(content, [(name, arguments)], finish_reason) assembled from the stream's deltas."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert entry["id"] is None and tc.type == "function"  # id and type come once, first
                    entry["id"] = tc.id
                if tc.function and tc.function.name:
                    entry["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    entry["arguments"] += tc.function.arguments
            finish = ch.finish_reason or finish
    assert all(e["id"] for e in calls.values())
    return content, [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)], finish


def test_required_calls_validate_plain_and_streamed(client, app, mode, shared_app):
    # One call (parallel_tool_calls=False): the grammar closes the array after it.
    kw = dict(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0,
              parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(choice.message.tool_calls) == 1 and choice.message.content is None
    _check_calls(choice.message.tool_calls)
    assert r.usage.completion_tokens > 0
    content, calls, finish = _streamed(client, **kw)
    assert finish == "tool_calls" and not content
    assert calls == [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    # Parallel calls are the same grammar without maxItems (test_tools checks the schema): the
    # random model never closes that array, so it is not asked here.
    assert_no_leaks(app, shared_app.name, shared_app.roles)


def test_named_call_validates_plain_and_streamed(client):
    kw = dict(model=NAME, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
              max_tokens=60, temperature=0)
    r = client.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"] and r.choices[0].finish_reason == "stop"
    _check_calls(calls)
    _, streamed, _ = _streamed(client, **kw)
    assert streamed == [("get_time", json.loads(calls[0].function.arguments))]


def test_a_tool_result_round_trips_through_the_template(client, tiny_model):
    from transformers import AutoTokenizer

    call = {"id": "call_abc", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Oslo", "days": 2}'}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_abc", "content": '{"temp_c": 4}'}]
    r = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, tool_choice="none",
                                       max_tokens=4, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content is not None
    tok = AutoTokenizer.from_pretrained(tiny_model)
    hf_messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": '{"temp_c": 4}'}]
    text = tok.apply_chat_template(hf_messages, tokenize=False, add_generation_prompt=True)  # none: no tools shown
    assert "<tool_call>" in text and '{"temp_c": 4}' in text
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("forced, calls", [
    ('Checking. <tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>',
     [("get_time", {"zone": "CET"})]),
    ("The tool_call syntax is <tool_call> then JSON.", []),
])
def test_auto_parses_the_models_text_with_hermes(client, forced, calls):
    """The model's text is forced (a regex) to something the parser must, or must not, read as
    a call: the whole answer and the stream agree with it."""
    import re

    kw = dict(model=NAME, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=80, temperature=0,
              extra_body={"structured_outputs": {"regex": re.escape(forced)}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    got = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
    assert got == calls
    assert r.choices[0].finish_reason == ("tool_calls" if calls else "stop")
    assert msg.content == ("Checking." if calls else forced)
    content, streamed, finish = _streamed(client, **kw)
    assert streamed == calls and content == (msg.content or "") and finish == r.choices[0].finish_reason


@pytest.mark.parametrize("override, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}, "tools"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_x", "content": "1"}]}, "messages"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_requests_are_400s_naming_the_field(app, override, param):
    body = {"model": NAME, "messages": ASK, "tools": TOOLS, "max_tokens": 4, **override}
    r = requests.post(f"{app}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
