"""The typed response bodies (cluster.http.openai_models) against the official openai client's
own models: what the chat and completions routes answer, whole and streamed, with logprobs,
tool calls and usage, parses as the SDK's ChatCompletion, ChatCompletionChunk and Completion;
the keys OpenAI leaves out stay out of the JSON; /openapi.json names every route's answer.
The routes run on the suite's tiny model with hand-made engine outputs (no engine)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.shared import ErrorObject

from cluster.http import openai_format as fmt
from cluster.http.chat import chat_job
from cluster.http.completions import completion_job
from cluster.http.ingress import app
from cluster.http.openai_models import ErrorResponse, ModelCard, ModelList
from cluster.http.protocol import ChatCompletionRequest, CompletionRequest
from cluster.http.served_model import ServedModel
from engine import EngineArgs
from engine.llm_engine import load_processor
from engine.outputs import CompletionOutput, Logprob, RequestOutput

NAME = "tiny"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def served(tiny_model) -> ServedModel:
    tokenizer, processor = load_processor(EngineArgs(tiny_model, max_model_len=512).create_engine_config())
    return ServedModel(NAME, tiny_model, tokenizer, processor, fmt.TokenText(tokenizer))


def _outputs(served: ServedModel, text: str, finish: str = "stop", logprobs: bool = False,
             prompt_ids: list[int] | None = None) -> list[RequestOutput]:
    """An engine's stream of `text`, one token per output, the last finished."""
    ids = served.tokenizer.encode(text, add_special_tokens=False)
    prompt_ids = prompt_ids or [5, 6, 7]
    prompt_lp = [None] + [{t: Logprob(-1.0, 3, served.text_of(t))} for t in prompt_ids[1:]]
    outs, so_far = [], []
    for k, tid in enumerate(ids):
        so_far = so_far + [tid]
        last = k == len(ids) - 1
        position = [{tid: -0.5, 9: -1.5, 11: -2.5}] if logprobs else None
        c = CompletionOutput(0, served.tokenizer.decode(so_far), list(so_far), finish if last else None,
                             None, [{t: -0.5, 9: -1.5, 11: -2.5} for t in so_far] if logprobs else None)
        outs.append(RequestOutput("r", None, prompt_ids, [c], last, delta_text=served.tokenizer.decode([tid]),
                                  delta_token_ids=[tid], delta_logprobs=position,
                                  prompt_logprobs=prompt_lp if logprobs else None))
    return outs


def _streamed(job, outputs: list[RequestOutput]) -> list[str]:
    """The job's SSE chunks' JSON for this engine stream."""
    async def merged():
        for out in outputs:
            yield 0, out

    async def run():
        return [fmt.to_json(c) async for c in job.chunks(merged())]

    return asyncio.run(run())


def _chat(served, **fields):
    body = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **fields}
    return chat_job(served, ChatCompletionRequest.model_validate(body))


def test_a_chat_answer_with_logprobs_is_the_sdks_chat_completion(served):
    job = _chat(served, logprobs=True, top_logprobs=2, prompt_logprobs=1)
    outs = _outputs(served, " the river", logprobs=True, prompt_ids=job.requests[0].prompt_token_ids)
    body = json.loads(fmt.to_json(job.whole([outs[-1]])))
    answer = ChatCompletion.model_validate(body)
    choice = answer.choices[0]
    assert (answer.object, answer.model, choice.message.role, choice.finish_reason) == (
        "chat.completion", NAME, "assistant", "stop")
    assert choice.message.content == " the river" and choice.message.tool_calls is None
    assert "tool_calls" not in body["choices"][0]["message"]  # no calls: no key, as OpenAI's
    assert [e.token for e in choice.logprobs.content] == [served.text_of(t) for t in outs[-1].outputs[0].token_ids]
    assert all(len(e.top_logprobs) == 2 and bytes(e.bytes).decode() == e.token for e in choice.logprobs.content)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    assert body["choices"][0]["stop_reason"] is None and body["prompt_logprobs"][0] is None  # vLLM's fields


def test_a_forced_tool_call_is_the_sdks_tool_call_whole_and_streamed(served):
    tool_choice = {"type": "function", "function": {"name": "get_weather"}}
    job = _chat(served, tools=[WEATHER], tool_choice=tool_choice)
    outs = _outputs(served, '{"city": "Lima"}')
    call = ChatCompletion.model_validate_json(fmt.to_json(job.whole([outs[-1]]))).choices[0].message.tool_calls[0]
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function", "get_weather", {"city": "Lima"})
    chunks = [ChatCompletionChunk.model_validate_json(c) for c in _streamed(_chat(
        served, tools=[WEATHER], tool_choice=tool_choice, stream=True), outs)]
    pieces = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].id and pieces[0].function.name == "get_weather"
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == {"city": "Lima"}


def test_chat_chunks_are_the_sdks_and_carry_usage_only_when_asked(served):
    outs = _outputs(served, " the river")
    plain = _streamed(_chat(served, stream=True), outs)
    assert all('"usage"' not in c for c in plain)
    chunks = [ChatCompletionChunk.model_validate_json(c) for c in plain]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == " the river"
    assert chunks[-1].choices[0].finish_reason == "stop"
    counted = _streamed(_chat(served, stream=True, stream_options={"include_usage": True}), outs)
    assert [('"usage"' in c) for c in counted] == [False] * (len(counted) - 1) + [True]
    last = ChatCompletionChunk.model_validate_json(counted[-1])
    assert last.choices == [] and last.usage.completion_tokens == len(outs)


def test_a_chat_chunk_is_the_json_sent_before_the_typed_models_byte_for_byte(served):
    outs = _outputs(served, " river")
    chunk = _streamed(_chat(served, stream=True), outs)[1]
    assert re.sub(r'"(id|created)":("[^"]*"|\d+)', r'"\1":0', chunk) == (
        '{"id":0,"object":"chat.completion.chunk","created":0,"model":"tiny","choices":[{"index":0,'
        f'"delta":{{"content":{json.dumps(outs[0].delta_text)}}},"logprobs":null,"finish_reason":null}}]}}')


def _completion(served, **fields):
    return completion_job(served, CompletionRequest.model_validate(
        {"model": NAME, "prompt": "The old mill", "max_tokens": 4, "logprobs": 2, **fields}))


def test_a_completion_with_logprobs_is_the_sdks_completion_whole_and_streamed(served):
    outs = _outputs(served, " stood", finish="length", logprobs=True)
    answer = Completion.model_validate_json(fmt.to_json(_completion(served).whole([outs[-1]])))
    choice = answer.choices[0]
    assert (answer.object, choice.text, choice.finish_reason) == ("text_completion", " stood", "length")
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and all(len(top) == 2 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    assert answer.usage.completion_tokens == len(outs)
    streamed = _streamed(_completion(served, stream=True), outs)
    assert all('"usage"' not in c for c in streamed)
    # The SDK's Completion says finish_reason is never null: only the last chunk has one.
    last = Completion.model_validate_json(streamed[-1]).choices[0]
    assert last.finish_reason == "length" and last.logprobs.tokens == lp.tokens[-1:]
    chunks = [json.loads(c)["choices"][0] for c in streamed]
    assert "".join(c["text"] for c in chunks) == choice.text
    assert [t for c in chunks for t in c["logprobs"]["tokens"]] == lp.tokens


def test_an_echoed_prompts_first_token_has_null_logprobs_as_openai_sends(served):
    """The SDK's types say a float, but OpenAI's (and vLLM's) answer has a null there, which
    the SDK's own parsing (no validation) keeps."""
    job = _completion(served, echo=True)
    outs = _outputs(served, " stood", logprobs=True, prompt_ids=job.requests[0].prompt_token_ids)
    choice = json.loads(fmt.to_json(job.whole([outs[-1]])))["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "The old mill stood" and "".join(lp["tokens"]) == choice["text"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert None not in lp["token_logprobs"][1:] and lp["text_offset"][0] == 0


def test_errors_and_the_model_list_are_the_sdks():
    err = json.loads(fmt.to_json(ErrorResponse.of("bad n", "invalid_request_error", "n", "invalid_n")))["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert ErrorObject.model_validate(err).param == "n"
    # Where no code names the error, it is the HTTP status, as vLLM sends it.
    assert json.loads(fmt.to_json(ErrorResponse.of("bad", "invalid_request_error", None, 400)))["error"]["code"] == 400
    listed = json.loads(fmt.to_json(ModelList(data=[ModelCard(id="m", created=1, root="/w", parent=None,
                                                              max_model_len=64)])))
    assert listed["object"] == "list" and Model.model_validate(listed["data"][0]).owned_by == "pdserve"
    assert listed["data"][0]["root"] == "/w" and listed["data"][0]["max_model_len"] == 64  # vLLM's


@pytest.mark.parametrize("method, path, schema", [
    ("post", "/v1/chat/completions", "ChatCompletionResponse"),
    ("post", "/v1/completions", "CompletionResponse"),
    ("post", "/v1/responses", "Response"),
    ("get", "/v1/models", "ModelList"),
    ("post", "/tokenize", "TokenizeResponse"),
    ("post", "/detokenize", "DetokenizeResponse"),
    ("get", "/tokenizer_info", "TokenizerInfoResponse"),
])
def test_openapi_names_each_routes_answer(method, path, schema):
    spec = app.openapi()
    answer = spec["paths"][path][method]["responses"]["200"]["content"]["application/json"]["schema"]
    assert answer == {"$ref": f"#/components/schemas/{schema}"}
    assert schema in spec["components"]["schemas"]
