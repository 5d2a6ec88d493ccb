"""POST /v1/responses: the Responses API as an adapter over the chat route.

Unit: input items, tools and text.format as the chat request they become; refused fields and
chat's errors as 400s naming the Responses field; the event stream made from hand-made chat
chunks (OpenAI's order, sequence numbers, every event valid for the openai SDK's models, the
deltas adding up to the final Response, which equals the non-streamed one). End to end, on the
suite's tiny model in P/D and colocated mode, with the official openai client. Oracles: the
same request through /v1/chat/completions (greedy), jsonschema, the SDK's own stream
accumulator (`responses.stream(...).get_final_response()`).
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import jsonschema
import pytest
import requests

from cluster.http import openai_format as fmt
from cluster.http.errors import OpenAIError
from cluster.http.openai_models import ChatCompletionChunk, ChatCompletionResponse
from cluster.http.responses import ResponsesRequest, responses_job
from cluster.http.responses_answer import Shell, adapt
from cluster.http.runner import RequestRunner
from cluster.http.served_model import Job, ServedModel
from tests.cluster.helpers import SHARED_NAME, assert_no_leaks, engine_request

NAME = SHARED_NAME
# A schema the grammar nearly fixes, so greedy decoding ends it (finish "stop") on a random model.
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "n"], "additionalProperties": False}
JSON_FORMAT = {"type": "json_schema", "name": "verdict", "schema": SCHEMA, "strict": True}


def _request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": NAME, "input": "hi", **fields})


# ---- the chat request a Responses request becomes ---------------------------------------------
def test_a_string_input_is_one_user_message_after_the_instructions_system_message():
    body = _request(input="Name a river.", instructions="Be terse.").chat_body("resp_1")
    assert body["messages"] == [{"role": "system", "content": "Be terse."},
                                {"role": "user", "content": "Name a river."}]
    assert body["request_id"] == "resp_1" and body["stream"] is False and "stream_options" not in body


def test_input_items_become_chat_messages_and_function_calls_join_their_assistant_turn():
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                        {"type": "input_text", "text": "Paris?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_a", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_b", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "noon"}]},
        {"type": "function_call", "call_id": "call_c", "name": "time", "arguments": "{}"},
    ]
    messages = _request(input=items).chat_body("r")["messages"]

    def call(call_id, name, arguments):
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}

    assert messages == [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.",
         "tool_calls": [call("call_a", "weather", '{"city": "Paris"}'), call("call_b", "time", "{}")]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": "noon"},
        {"role": "assistant", "content": None, "tool_calls": [call("call_c", "time", "{}")]},
    ]


def test_tools_tool_choice_text_format_and_sampling_fields_map_to_chats():
    tool = {"type": "function", "name": "weather", "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": True}
    body = _request(tools=[tool], tool_choice={"type": "function", "name": "weather"}, parallel_tool_calls=False,
                    text={"format": JSON_FORMAT}, max_output_tokens=20, temperature=0.5, top_p=0.9,
                    user="u1", stream=True).chat_body("r")
    assert body["tools"] == [{"type": "function", "function": {
        "name": "weather", "description": "Weather of a city", "parameters": tool["parameters"], "strict": True}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert body["parallel_tool_calls"] is False
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "verdict", "schema": SCHEMA, "strict": True}}
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["user"]) == (20, 0.5, 0.9, "u1")
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    for choice in ("none", "auto", "required"):
        assert _request(tool_choice=choice).chat_body("r")["tool_choice"] == choice
    assert _request(text={"format": {"type": "json_object"}}).chat_body("r")["response_format"] == {
        "type": "json_object"}
    assert _request(text={"format": {"type": "text"}}).chat_body("r")["response_format"] == {"type": "text"}
    plain = _request().chat_body("r")
    assert not {"tools", "tool_choice", "parallel_tool_calls", "response_format"} & set(plain)


@pytest.mark.parametrize("fields, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function", "description": "no name"}]}, "tools"),
])
def test_fields_pdserve_cannot_honour_are_400s_naming_them(fields, param):
    body = _request(**fields)
    with pytest.raises(OpenAIError) as e:
        body.check_supported()
        body.chat_body("r")
    assert e.value.status == 400 and e.value.param == param


def test_store_false_background_false_and_ignored_fields_are_accepted():
    body = _request(store=False, background=False, include=["reasoning.encrypted_content"],
                    reasoning={"effort": "low"}, truncation="disabled", metadata={"k": "v"})
    body.check_supported()
    assert body.chat_body("r")["messages"] == [{"role": "user", "content": "hi"}]
    assert body.echo()["metadata"] == {"k": "v"} and body.echo()["store"] is False


def test_an_input_item_of_another_type_is_refused_by_the_model():
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as e:
        _request(input=[{"type": "item_reference", "id": "msg_1"}])
    assert e.value.errors()[0]["loc"][0] == "input"


# ---- through the chat route's own checks (a ServedModel on the tiny model) -----------------------
@pytest.fixture(scope="module")
def served(tiny_model) -> ServedModel:
    from engine import EngineArgs
    from engine.llm_engine import load_processor

    tokenizer, processor = load_processor(EngineArgs(tiny_model, max_model_len=64).create_engine_config())
    return ServedModel(NAME, tiny_model, tokenizer, processor, fmt.TokenText(tokenizer))


def test_the_job_runs_the_prompt_chat_renders_for_the_same_messages(served):
    from cluster.http.chat import chat_job
    from cluster.http.protocol import ChatCompletionRequest

    job = responses_job(served, _request(input="Name a river.", instructions="Be terse.", max_output_tokens=5))
    chat = chat_job(served, ChatCompletionRequest.model_validate({"model": NAME, "max_tokens": 5, "messages": [
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a river."}]}))
    def run(j):
        return [(r.prompt_token_ids, r.prompt, r.sampling_params) for r in j.requests]

    assert run(job) == run(chat)
    assert job.request_id.startswith("resp_") and job.sse.done is False and chat.sse.done is True


@pytest.mark.parametrize("fields, param", [
    ({"max_output_tokens": 500}, "max_output_tokens"),  # beyond the context of 64
    ({"input": "word " * 80}, "input"),  # the prompt alone fills the context
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}}, "text.format"),
    ({"temperature": -1}, "temperature"),
    ({"model": "gpt-4o"}, "model"),
])
def test_chat_route_errors_name_the_responses_field(served, fields, param):
    with pytest.raises(OpenAIError) as e:
        responses_job(served, _request(**fields))
    assert e.value.param == param and e.value.status == (404 if param == "model" else 400)


# ---- the answer, from hand-made chat answers and chunks -------------------------------------
def _shell() -> Shell:
    return Shell("resp_t", 1700000000, NAME, _request().echo())


def _chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> ChatCompletionChunk:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    return ChatCompletionChunk.model_validate({"id": "resp_t", "object": "chat.completion.chunk", "created": 0,
                                               "model": NAME, "choices": choices, "usage": usage})


def _fake_chat(chunks: list[dict], message: dict, finish: str, usage: dict) -> Job:
    """A chat Job whose stream is `chunks` and whose whole answer is `message`."""
    async def chat_chunks(merged):
        for c in chunks:
            yield c

    answer = ChatCompletionResponse.model_validate({
        "id": "resp_t", "object": "chat.completion", "created": 0, "model": NAME, "usage": usage,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish, "stop_reason": None}]})
    return Job([], "resp_t", True, chat_chunks, lambda finals: answer)


def _events(job: Job) -> list[dict]:
    """The stream's events as their JSON says."""
    async def run():
        return [json.loads(e.model_dump_json()) async for e in job.chunks(None)]

    return asyncio.run(run())


def _whole(job: Job) -> dict:
    return json.loads(job.whole([]).model_dump_json())


USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
TEXT_CHUNKS = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Hel"}), _chunk({"content": "lo"}),
               _chunk({}, "stop"), _chunk(usage=USAGE)]
CALL_CHUNKS = [
    _chunk({"role": "assistant", "content": ""}), _chunk({"content": "Let me check."}),
    _chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                            "function": {"name": "weather", "arguments": ""}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
    _chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                            "function": {"name": "time", "arguments": "{}"}}]}),
    _chunk({}, "tool_calls"), _chunk(usage=USAGE)]
CALL_MESSAGE = {"role": "assistant", "content": "Let me check.", "tool_calls": [
    {"id": "call_a", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
    {"id": "call_b", "type": "function", "function": {"name": "time", "arguments": "{}"}}]}


def _sdk_valid(events: list[dict]) -> None:
    """Every event parses as the openai SDK's own model of its type (none falls to another)."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(ResponseStreamEvent)
    for e in events:
        assert adapter.validate_python(e).type == e["type"]


def _without_ids(response: dict) -> dict:
    return {**response, "output": [{k: v for k, v in item.items() if k != "id"} for item in response["output"]]}


def _check_stream_adds_up(events: list[dict], terminal: str) -> dict:
    """OpenAI's order and numbering, and the deltas adding up to each item and to the final Response."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert events[-1]["type"] == terminal and all(e["type"] != terminal for e in events[:-1])
    final = events[-1]["response"]
    body = events[2:-1]
    for index, item in enumerate(final["output"]):
        mine = [e for e in body if e.get("output_index") == index]
        # Each item whole (added ... done) before the next one starts.
        assert body[:len(mine)] == mine
        body = body[len(mine):]
        assert mine[0]["type"] == "response.output_item.added" and mine[0]["item"]["id"] == item["id"]
        assert mine[-1] == {"type": "response.output_item.done", "sequence_number": mine[-1]["sequence_number"],
                            "output_index": index, "item": item}
        kinds = [e["type"] for e in mine]
        if item["type"] == "message":
            deltas = [e["delta"] for e in mine if e["type"] == "response.output_text.delta"]
            assert kinds == ["response.output_item.added", "response.content_part.added",
                             *["response.output_text.delta"] * len(deltas), "response.output_text.done",
                             "response.content_part.done", "response.output_item.done"]
            text = item["content"][0]["text"]
            assert "".join(deltas) == text and mine[-3]["text"] == text and mine[-2]["part"]["text"] == text
        else:
            deltas = [e["delta"] for e in mine if e["type"] == "response.function_call_arguments.delta"]
            assert kinds == ["response.output_item.added", *["response.function_call_arguments.delta"] * len(deltas),
                             "response.function_call_arguments.done", "response.output_item.done"]
            assert "".join(deltas) == item["arguments"] == mine[-2]["arguments"]
        assert all(e.get("item_id", item["id"]) == item["id"] for e in mine)
    assert body == []
    _sdk_valid(events)
    return final


def test_a_streamed_text_answer_is_openais_event_sequence_adding_up_to_the_response():
    job = adapt(_fake_chat(TEXT_CHUNKS, {"role": "assistant", "content": "Hello"}, "stop", USAGE), _shell())
    events = _events(job)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    final = _check_stream_adds_up(events, "response.completed")
    assert final["status"] == "completed" and final["incomplete_details"] is None
    assert final["output"][0]["content"][0]["text"] == "Hello" and final["output"][0]["status"] == "completed"
    assert final["usage"]["input_tokens"] == 7 and final["usage"]["output_tokens"] == 5
    assert final["usage"]["total_tokens"] == 12
    assert _without_ids(final) == _without_ids(_whole(job))


def test_streamed_tool_calls_are_function_call_items_after_the_text():
    job = adapt(_fake_chat(CALL_CHUNKS, CALL_MESSAGE, "tool_calls", USAGE), _shell())
    events = _events(job)
    final = _check_stream_adds_up(events, "response.completed")
    assert [(i["type"], i.get("call_id"), i.get("name"), i.get("arguments")) for i in final["output"]] == [
        ("message", None, None, None), ("function_call", "call_a", "weather", '{"city": "Paris"}'),
        ("function_call", "call_b", "time", "{}")]
    assert all(i["status"] == "completed" for i in final["output"])
    assert final["output"][1]["id"].startswith("fc_") and final["output"][0]["id"].startswith("msg_")
    assert _without_ids(final) == _without_ids(_whole(job))


def test_a_length_cut_is_an_incomplete_response_with_the_reason():
    chunks = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Hel"}), _chunk({}, "length"),
              _chunk(usage=USAGE)]
    job = adapt(_fake_chat(chunks, {"role": "assistant", "content": "Hel"}, "length", USAGE), _shell())
    final = _check_stream_adds_up(_events(job), "response.incomplete")
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"
    assert _without_ids(final) == _without_ids(_whole(job))


def test_an_empty_answer_is_one_empty_message_streamed_or_not():
    chunks = [_chunk({"role": "assistant", "content": ""}), _chunk({}, "stop"), _chunk(usage=USAGE)]
    job = adapt(_fake_chat(chunks, {"role": "assistant", "content": ""}, "stop", USAGE), _shell())
    final = _check_stream_adds_up(_events(job), "response.completed")
    assert [i["content"][0]["text"] for i in final["output"]] == [""]
    assert _without_ids(final) == _without_ids(_whole(job))


def test_the_response_object_is_valid_for_the_sdk_and_echoes_the_request():
    from openai.types.responses import Response

    echo = _request(instructions="Be terse.", max_output_tokens=9, temperature=0, text={"format": JSON_FORMAT},
                    tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                    tool_choice="required", metadata={"k": "v"}).echo()
    job = adapt(_fake_chat([], CALL_MESSAGE, "tool_calls", USAGE), Shell("resp_t", 1, NAME, echo))
    r = Response.model_validate(_whole(job))
    assert (r.id, r.object, r.status, r.model, r.instructions, r.max_output_tokens) == (
        "resp_t", "response", "completed", NAME, "Be terse.", 9)
    assert r.temperature == 0 and r.top_p == 1.0 and r.tool_choice == "required" and r.metadata == {"k": "v"}
    assert r.text.format.type == "json_schema" and r.text.format.schema_ == SCHEMA
    assert [t.name for t in r.tools] == ["f"] and r.parallel_tool_calls is True
    assert r.output_text == "Let me check." and r.usage.input_tokens_details.cached_tokens == 0


def test_a_failed_stream_ends_with_an_error_event_and_no_done():
    """Through the ingress's own SSE writer: the engine fails mid-request."""
    from cluster.http.ingress import Ingress
    from cluster.http.metrics import AppMetrics
    from engine.outputs import CompletionOutput, RequestOutput

    class Streams:
        async def generate(self, request):
            request_id = request.request_id
            yield RequestOutput(request_id, None, [1], [CompletionOutput(0, "a", [5])], finished=False,
                                delta_token_ids=[5], delta_text="a")
            yield RequestOutput(request_id, None, [1], [CompletionOutput(0, "a", [5], finish_reason="error",
                                                                         stop_reason="core 1 failed")],
                                finished=True)

    ing = object.__new__(Ingress)
    ing._pending, ing.max_pending, ing._pusher = {}, 4, None
    ing.mode, ing.metrics = "colocated", AppMetrics("m", "colocated")
    ing.runner = RequestRunner(Streams(), ing.metrics)
    ing.served = SimpleNamespace(loras=None)  # no LoRA adapters (cluster.http.lora)

    async def chat_chunks(merged):
        async for _, out in merged:
            yield _chunk({"content": out.delta_text})

    chat = Job([engine_request("r", [1])], "resp_t", True, chat_chunks, lambda finals: {})

    async def run():
        response = await ing.respond(adapt(chat, _shell()))
        return [e async for e in response.body_iterator]

    pieces = asyncio.run(run())
    assert all(p.startswith("event: ") for p in pieces)
    events = [json.loads(p.split("\ndata: ", 1)[1]) for p in pieces]
    assert [p.split("\n", 1)[0] for p in pieces] == [f"event: {e['type']}" for e in events]
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "error"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["code"] == "service_unavailable" and "core 1 failed" in events[-1]["message"]
    _sdk_valid(events)
    assert ing.pending == 0


# ---- end to end: the official openai client against the app on the tiny model ------------------
INSTRUCTIONS, QUESTION = "Be terse.", "Name a river."
CHAT_MESSAGES = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
CHAT_JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}


def test_text_equals_the_chat_routes_greedy_answer(client):
    r = client.responses.create(model=NAME, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=16,
                                temperature=0)
    chat = client.chat.completions.create(model=NAME, messages=CHAT_MESSAGES, max_tokens=16, temperature=0)
    choice = chat.choices[0]
    assert r.output_text == choice.message.content and r.output_text
    assert r.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    assert r.id.startswith("resp_") and r.model == NAME and [o.type for o in r.output] == ["message"]


def _raw_events(response) -> list[tuple[str, dict | str]]:
    """(event line, data) of each SSE event of a raw response."""
    events, name = [], None
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data = line[len("data: "):]
            events.append((name, data if data == "[DONE]" else json.loads(data)))
            name = None
    return events


def test_a_streamed_text_adds_up_to_the_chat_answer_with_named_events_and_no_done(client, app):
    events = list(client.responses.create(model=NAME, instructions=INSTRUCTIONS, input=QUESTION,
                                          max_output_tokens=16, temperature=0, stream=True))
    chat = client.chat.completions.create(model=NAME, messages=CHAT_MESSAGES, max_tokens=16, temperature=0)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    terminal = "response.incomplete" if chat.choices[0].finish_reason == "length" else "response.completed"
    assert events[-1].type == terminal
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == chat.choices[0].message.content
    assert events[-1].response.usage.output_tokens == chat.usage.completion_tokens
    # On the wire: each event named on its `event:` line, no `data: [DONE]` after the last.
    r = requests.post(f"{app}/v1/responses", json={"model": NAME, "input": QUESTION, "max_output_tokens": 4,
                                                   "stream": True}, stream=True, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    raw = _raw_events(r)
    assert all(isinstance(data, dict) and name == data["type"] for name, data in raw)
    assert raw[-1][0] in ("response.completed", "response.incomplete")


def test_a_json_schema_text_format_answers_valid_json_equal_to_chats(client):
    r = client.responses.create(model=NAME, input=QUESTION, text={"format": JSON_FORMAT}, max_output_tokens=40,
                                temperature=0)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTION}],
                                          response_format=CHAT_JSON_FORMAT, max_tokens=40, temperature=0)
    assert r.output_text == chat.choices[0].message.content


def test_the_sdks_stream_helper_ends_with_the_final_response(client):
    kw = dict(model=NAME, input=QUESTION, text={"format": JSON_FORMAT}, max_output_tokens=40, temperature=0)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    plain = client.responses.create(**kw)
    assert final.output_text == plain.output_text
    jsonschema.validate(json.loads(final.output_text), SCHEMA)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    assert final.id == events[0].response.id and final.status == "completed"
    assert final.usage.output_tokens == plain.usage.output_tokens


TOOL = {"type": "function", "name": "verdict", "description": "Give a verdict.", "parameters": SCHEMA}
CHAT_TOOL = {"type": "function", "function": {"name": "verdict", "description": "Give a verdict.",
                                              "parameters": SCHEMA}}


def test_a_forced_function_call_is_a_function_call_item_equal_to_chats_tool_call(client):
    kw = dict(model=NAME, input=QUESTION, tools=[TOOL], tool_choice={"type": "function", "name": "verdict"},
              max_output_tokens=40, temperature=0)
    r = client.responses.create(**kw)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTION}],
                                          tools=[CHAT_TOOL], max_tokens=40, temperature=0,
                                          tool_choice={"type": "function", "function": {"name": "verdict"}})
    [call] = r.output
    [chat_call] = chat.choices[0].message.tool_calls
    assert call.type == "function_call" and call.name == chat_call.function.name == "verdict"
    assert call.arguments == chat_call.function.arguments and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [(o.type, o.name, o.arguments) for o in final.output] == [("function_call", "verdict", call.arguments)]
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments


def test_function_call_items_and_their_outputs_continue_the_conversation_as_chat_does(client):
    arguments = '{"answer": "yes", "n": 1}'
    items = [{"role": "user", "content": QUESTION},
             {"type": "function_call", "call_id": "call_1", "name": "verdict", "arguments": arguments},
             {"type": "function_call_output", "call_id": "call_1", "output": "recorded"}]
    r = client.responses.create(model=NAME, input=items, tools=[TOOL], tool_choice="none", max_output_tokens=12,
                                temperature=0)
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "verdict", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "recorded"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, tools=[CHAT_TOOL], tool_choice="none",
                                          max_tokens=12, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize("fields, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}}, "text.format"),
])
def test_refused_and_invalid_fields_are_openai_400s_naming_them(app, fields, param):
    r = requests.post(f"{app}/v1/responses", json={"model": NAME, "input": "hi", **fields}, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_an_unknown_model_is_a_404(app):
    r = requests.post(f"{app}/v1/responses", json={"model": "gpt-4o", "input": "hi"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_a_repeated_input_reports_the_prompt_tokens_its_prefill_found_cached(client, mode):
    """In P/D the count is the prefill replica's prefix-cache hit (the decode side loads the
    whole prompt's KV, which is no cache hit); colocated, the one engine's."""
    text = f"cached in {mode}: " + " ".join(f"w{i}" for i in range(80))
    first = client.responses.create(model=NAME, input=text, max_output_tokens=2)
    again = client.responses.create(model=NAME, input=text, max_output_tokens=2)
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert again.usage.input_tokens_details.cached_tokens == (again.usage.input_tokens - 1) // 16 * 16 > 0


def test_no_request_or_kv_block_is_left_on_the_replicas(app, mode, shared_app):
    assert_no_leaks(app, shared_app.name, shared_app.roles)
