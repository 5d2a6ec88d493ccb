"""--reasoning-parser over HTTP, read by the official openai client: a reasoning model's answer
(here scripted, as the tiny test model writes no tags) comes back split into reasoning_content
and content, whole and streamed alike, tool calls parsed from the answer after the thinking,
include_reasoning false dropping the thinking."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from cluster.http.reasoning import get_reasoning_parser
from tests.cluster.ingress_harness import make_ingress, serve_ingress

NAME = "m"
THINKING = "The user wants 2+2. That is 4."
ANSWER = "The answer is 4."
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}


class ScriptedEngines:
    """An EngineClient whose every answer is `text`, three characters per step."""

    def __init__(self) -> None:
        self.text = ""
        self.last = None  # the last request, as the engine got it

    async def generate(self, request):
        from engine.outputs import CompletionOutput, RequestOutput

        self.last = request
        text, ids = self.text, request.prompt_token_ids
        pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            so_far = "".join(pieces[:k + 1])
            yield RequestOutput(request.request_id, request.prompt, ids,
                                [CompletionOutput(0, so_far, list(range(k + 1)), finish_reason="stop" if last else None)],
                                finished=last, delta_text=piece, delta_token_ids=[k])
            await asyncio.sleep(0)


@pytest.fixture(scope="module", params=["deepseek_r1", "qwen3"])
def served(request, tiny_model):
    engines = ScriptedEngines()
    ingress = make_ingress(tiny_model, name=NAME, engines=engines)
    from cluster.http.tool_parsers import get_tool_parser

    ingress.served = dataclasses.replace(ingress.served, reasoning_parser=get_reasoning_parser(request.param),
                                         tool_parser=get_tool_parser("hermes"), enable_auto_tool_choice=True)
    s = serve_ingress(ingress)
    opening = "" if request.param == "deepseek_r1" else "<think>"  # deepseek's template opens it
    yield s, engines, opening
    s.stop()


def _client(url):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def _ask(client, **kw):
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "2+2?"}],
                                          max_tokens=64, **kw)


def _streamed(client, **kw):
    reasoning, content, calls, finish = "", "", [], None
    for chunk in _ask(client, stream=True, **kw):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    return reasoning, content, calls, finish


def test_thinking_and_answer_are_split_whole_and_streamed(served):
    s, engines, opening = served
    engines.text = f"{opening}{THINKING}</think>{ANSWER}"
    client = _client(s.url)
    message = _ask(client).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (THINKING, ANSWER)
    assert _streamed(client)[:2] == (THINKING, ANSWER)
    # include_reasoning false: the answer alone.
    quiet = _ask(client, extra_body={"include_reasoning": False}).choices[0].message
    assert "reasoning_content" not in (quiet.model_extra or {}) and quiet.content == ANSWER
    assert _streamed(client, extra_body={"include_reasoning": False})[:2] == ("", ANSWER)


def test_tool_calls_are_parsed_from_the_answer_after_the_thinking(served):
    s, engines, opening = served
    # The thinking mentions a call that is not one: only the answer's call counts.
    engines.text = f"{opening}I could write <tool_call> here.</think>{CALL}"
    client = _client(s.url)
    choice = _ask(client, tools=[TIME]).choices[0]
    assert choice.message.model_extra["reasoning_content"] == "I could write <tool_call> here."
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"] and choice.finish_reason == "tool_calls"
    reasoning, content, calls, finish = _streamed(client, tools=[TIME])
    assert reasoning == "I could write <tool_call> here." and not content.strip()
    assert [c.function.name for c in calls if c.function.name] == ["get_time"] and finish == "tool_calls"


def test_an_answer_without_thinking(served):
    s, engines, opening = served
    engines.text = ANSWER
    message = _ask(_client(s.url)).choices[0].message
    if opening:  # qwen3: the model wrote no <think>: all answer
        assert message.content == ANSWER and "reasoning_content" not in (message.model_extra or {})
    else:  # deepseek_r1: its template opened <think>, and it never closed: all thinking
        assert message.model_extra["reasoning_content"] == ANSWER and message.content is None


def test_the_responses_api_returns_the_thinking_as_a_reasoning_item_whole_and_streamed(served):
    s, engines, opening = served
    engines.text = f"{opening}{THINKING}</think>{ANSWER}"
    client = _client(s.url)
    r = client.responses.create(model=NAME, input="2+2?", max_output_tokens=64)
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == THINKING and r.output_text == ANSWER
    events = list(client.responses.create(model=NAME, input="2+2?", max_output_tokens=64, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == THINKING
    done = [e for e in events if e.type == "response.reasoning_text.done"]
    assert len(done) == 1 and done[0].text == THINKING and done[0].output_index == 0
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == ANSWER
    # Thinking alone (cut by the length): a reasoning item and an empty message, both ways.
    engines.text = f"{opening}{THINKING}"
    whole = client.responses.create(model=NAME, input="2+2?", max_output_tokens=64)
    streamed = list(client.responses.create(model=NAME, input="2+2?", max_output_tokens=64, stream=True))[-1].response
    assert [i.type for i in whole.output] == [i.type for i in streamed.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == streamed.output[0].content[0].text == THINKING


def test_a_grammar_starts_after_the_thinking_when_the_model_is_to_think(served, tiny_model):
    """As vLLM's: structured outputs (and forced tool calls) constrain the answer after
    `</think>`; a prompt whose template closed the thinking already is constrained at once."""
    from transformers import AutoTokenizer

    s, engines, opening = served
    engines.text = f'{opening}{THINKING}</think>{{"a": 1}}'
    client = _client(s.url)
    r = _ask(client, response_format={"type": "json_object"})
    end = tuple(AutoTokenizer.from_pretrained(tiny_model).encode("</think>", add_special_tokens=False))
    assert engines.last.sampling_params.structured_outputs.after_tokens == end
    message = r.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (THINKING, '{"a": 1}')
    # The template closed the thinking (here: an assistant turn continued after an empty one).
    engines.text = '{"a": 1}'
    closed = client.chat.completions.create(
        model=NAME, max_tokens=16, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\n\n</think>\n\n"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert engines.last.sampling_params.structured_outputs.after_tokens is None
    assert closed.choices[0].message.content == '{"a": 1}'
