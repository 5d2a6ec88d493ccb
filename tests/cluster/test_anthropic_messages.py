"""POST /v1/messages (Anthropic's Messages API) read by the official anthropic SDK: the same
answer as the chat route for the same conversation (a real engine), whole and streamed; tool
use both ways (scripted answers, as the tiny model writes no calls); errors in Anthropic's
shape; count_tokens; the x-api-key header."""

from __future__ import annotations

import dataclasses

import pytest

from tests.cluster.ingress_harness import make_ingress, serve_ingress
from tests.cluster.test_serve_reasoning import CALL, ScriptedEngines

NAME = "m"
TEXT = "Tell me about the river and the stone."
WEATHER = {"name": "get_time", "description": "the time in a zone",
           "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}


@pytest.fixture(scope="module")
def real(tiny_model):
    from engine import AsyncLLM, EngineArgs

    engine = AsyncLLM.from_engine_args(EngineArgs(tiny_model, max_model_len=256))
    s = serve_ingress(make_ingress(tiny_model, name=NAME, engines=engine))
    yield s
    s.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def scripted(tiny_model):
    from cluster.http.tool_parsers import get_tool_parser

    engines = ScriptedEngines()
    ingress = make_ingress(tiny_model, name=NAME, engines=engines, max_model_len=1024)
    ingress.served = dataclasses.replace(ingress.served, tool_parser=get_tool_parser("hermes"),
                                         enable_auto_tool_choice=True)
    s = serve_ingress(ingress)
    yield s, engines
    s.stop()


def _anthropic(url, api_key="none"):
    from anthropic import Anthropic

    return Anthropic(base_url=url, api_key=api_key, max_retries=0)


def _openai(url):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def test_a_message_is_the_chat_answer_whole_and_streamed(real):
    chat = _openai(real.url).chat.completions.create(
        model=NAME, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}],
        max_tokens=12, temperature=0)
    client = _anthropic(real.url)
    kw = dict(model=NAME, max_tokens=12, extra_body={"temperature": 0}, system="Be brief.", messages=[{"role": "user", "content": TEXT}])
    message = client.messages.create(**kw)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == "max_tokens" and chat.choices[0].finish_reason == "length"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    with client.messages.stream(**kw) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == message.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 12 and final.usage.input_tokens == chat.usage.prompt_tokens
    assert events[0] == "message_start" and events[-1] == "message_stop" and "content_block_stop" in events
    assert client.messages.count_tokens(model=NAME, system="Be brief.",
                                        messages=[{"role": "user", "content": TEXT}]).input_tokens == chat.usage.prompt_tokens


def test_stop_sequences_end_the_turn_and_say_which(real):
    client = _anthropic(real.url)
    plain = client.messages.create(model=NAME, max_tokens=8, extra_body={"temperature": 0}, messages=[{"role": "user", "content": TEXT}])
    words = plain.content[0].text.split()
    assert len(words) >= 2, plain.content[0].text  # the tiny model's greedy answer has words to stop at
    stopped = client.messages.create(model=NAME, max_tokens=8, extra_body={"temperature": 0}, stop_sequences=[words[1]],
                                     messages=[{"role": "user", "content": TEXT}])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == words[1]
    assert words[1] not in stopped.content[0].text


def test_tool_use_and_its_result_both_ways(scripted):
    s, engines = scripted
    engines.text = "Let me look." + CALL
    client = _anthropic(s.url)
    kw = dict(model=NAME, max_tokens=64, tools=[WEATHER], messages=[{"role": "user", "content": "Time in Paris?"}])
    message = client.messages.create(**kw)
    assert message.stop_reason == "tool_use"
    text, use = message.content
    assert text.type == "text" and text.text == "Let me look."
    assert (use.type, use.name, use.input) == ("tool_use", "get_time", {"zone": "CET"})
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.content[1].input == {"zone": "CET"}
    assert final.stop_reason == "tool_use"
    # The next turn sends the call and its result back; the answer is plain text.
    engines.text = "It is noon."
    answer = client.messages.create(model=NAME, max_tokens=64, tools=[WEATHER], messages=[
        {"role": "user", "content": "Time in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": "get_time", "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "12:00"}]}])
    assert answer.content[0].text == "It is noon." and answer.stop_reason == "end_turn"
    # tool_choice any/tool force a call (a grammar): the scripted text is not JSON, so only the
    # mapping is checked here, by what the route accepts.
    none = client.messages.create(**kw, tool_choice={"type": "none"})
    assert none.stop_reason == "end_turn" and not [b for b in none.content if b.type == "tool_use"]


def test_errors_come_in_anthropics_shape(real):
    import anthropic

    client = _anthropic(real.url)
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-x", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=NAME, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert "thinking" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=NAME, max_tokens=0, messages=[{"role": "user", "content": "hi"}])


def test_the_x_api_key_header_is_an_api_key(tiny_model):
    import anthropic

    from cluster.http import ingress as ingress_module
    from cluster.http.auth import ApiKeyCheck, digest

    s = serve_ingress(make_ingress(tiny_model, name=NAME))
    try:
        ingress_module._api_keys = ApiKeyCheck([digest("sekret")])
        ok = _anthropic(s.url, api_key="sekret").messages.create(model=NAME, max_tokens=2,
                                                                   messages=[{"role": "user", "content": "hi"}])
        assert ok.content[0].text
        with pytest.raises(anthropic.AuthenticationError):
            _anthropic(s.url, api_key="wrong").messages.create(model=NAME, max_tokens=2,
                                                               messages=[{"role": "user", "content": "hi"}])
    finally:
        ingress_module._api_keys = None
        s.stop()
