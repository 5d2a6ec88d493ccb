"""A property-based test over the ingress's OpenAPI schema (schemathesis): whatever the body,
method or field values, the ingress answers below 500, every error in OpenAI's shape, and a
stream never ends in a 5xx error event.

Every operation of the schema (`/openapi.json`: the generation routes, the tokenizer routes,
/health, /metrics, /status, /scale, /v1/models) gets schemathesis's coverage phase (boundary
and schema-violating values of each field, other HTTP methods) and 10 fuzzed cases,
derandomized so every run sends the same cases: 1,505 requests with schemathesis 4.32
(docs/serving.md#limits). The app is the real one (tests/cluster/ingress_harness.py): parsing,
chat templates, tokenization and validation run as in a replica; the engine is a stand-in for
every operation, and the generation operations (chat, completions) are fuzzed again against a
real engine (an in-process AsyncLLM of the tiny model): whatever a valid-looking request asks
of it, no 5xx, no error event, and the engine holds no request or KV block afterwards.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.config import SchemathesisConfig

from cluster.http.ingress import app
from tests.cluster.ingress_harness import make_ingress, serve_ingress

NAME = "m"
FUZZED_PER_OPERATION = 10
CONFIG = SchemathesisConfig.from_dict({
    "phases": {"examples": {"enabled": False}, "coverage": {"enabled": True}, "fuzzing": {"enabled": True},
               "stateful": {"enabled": False}},
    "generation": {"max-examples": FUZZED_PER_OPERATION},
})
schema = schemathesis.openapi.from_dict(app.openapi(), config=CONFIG)
# Cases sent, per (method, path, status): a record of what the run covered.
SENT: dict[tuple[str, str, int], int] = {}


@pytest.fixture(scope="module")
def served(tiny_model):
    s = serve_ingress(make_ingress(tiny_model, name=NAME))
    yield s
    s.stop()
    print(f"\nschemathesis sent {sum(SENT.values())} requests:",
          {key: SENT[key] for key in sorted(SENT)})


def _assert_error_shape(path: str, response) -> None:
    """OpenAI's error shape, or Anthropic's on its Messages routes."""
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"], \
            response.text[:500]
        return
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], response.text[:500]


def _stream_errors(text: str) -> list[dict]:
    """The error objects among an SSE body's `data:` events."""
    errors = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[len("data: "):])
            if isinstance(event, dict) and "error" in event:
                errors.append(event["error"])
    return errors


@schema.parametrize()
@settings(max_examples=FUZZED_PER_OPERATION, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_5xx(case, served):
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = NAME  # the served name: most cases get past the 404 to the validation
    response = case.call(base_url=served.url, timeout=60)
    key = (case.method, case.path, response.status_code)
    SENT[key] = SENT.get(key, 0) + 1
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if response.status_code >= 400:
        _assert_error_shape(case.path, response)
    elif "text/event-stream" in response.headers.get("content-type", [""])[0]:
        failed = [e for e in _stream_errors(response.text) if int(e.get("code") or 500) >= 500]
        assert not failed, (case.body, failed)


# ---- the generation operations against a real engine ----------------------------------------
GENERATION = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
REAL_MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def real(tiny_model):
    from engine import AsyncLLM, EngineArgs

    engine = AsyncLLM.from_engine_args(EngineArgs(tiny_model, max_model_len=REAL_MAX_MODEL_LEN))
    s = serve_ingress(make_ingress(tiny_model, name=NAME, engines=engine, max_model_len=REAL_MAX_MODEL_LEN))
    yield s, engine
    s.stop()
    engine.shutdown()


@schema.include(path_regex="^(" + "|".join(GENERATION) + ")$").parametrize()
@settings(max_examples=FUZZED_PER_OPERATION, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_generation_request_gets_a_5xx_from_a_real_engine(case, real):
    served, engine = real
    if isinstance(case.body, dict):
        if isinstance(case.body.get("model"), str):
            case.body["model"] = NAME
        if isinstance(case.body.get("max_tokens"), int) and case.body["max_tokens"] > 8:
            case.body["max_tokens"] = 8  # the tiny model's context is short: keep the engine's share brief
    response = case.call(base_url=served.url, timeout=120)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if response.status_code >= 400:
        _assert_error_shape(case.path, response)
    elif "text/event-stream" in response.headers.get("content-type", [""])[0]:
        assert not _stream_errors(response.text), (case.body, response.text[:500])
    _assert_engine_idle(engine)


def _assert_engine_idle(engine) -> None:
    figures = asyncio.run(engine.load())
    assert (figures.running, figures.waiting) == (0, 0), figures  # nothing left behind
    assert figures.free_blocks == figures.total_blocks, figures


# Schema-driven cases are mostly refused before the engine (a fuzzed body is rarely valid), so
# the engine is also given bodies valid in shape with every sampling field drawn in or near its
# range: each is answered 200 (or a 400 naming a field), never a 5xx or an error event.
_words = st.sampled_from(["a", "the", "cat", "\n", "ok", "zz", "日本", ""])
_sampling = st.fixed_dictionaries({}, optional={
    "temperature": st.sampled_from([0, 0.5, 1.0, 2.0]), "top_p": st.sampled_from([0.1, 0.9, 1.0]),
    "top_k": st.sampled_from([-1, 0, 1, 5]), "min_p": st.sampled_from([0.0, 0.2]),
    "n": st.integers(1, 3), "seed": st.integers(0, 2**31), "stream": st.booleans(),
    "max_tokens": st.integers(1, 8), "min_tokens": st.integers(0, 4), "ignore_eos": st.booleans(),
    "stop": st.lists(_words, max_size=3), "presence_penalty": st.sampled_from([-2.0, 0.0, 1.5]),
    "frequency_penalty": st.sampled_from([0.0, 2.0]), "repetition_penalty": st.sampled_from([0.5, 1.0, 1.3]),
    "logit_bias": st.dictionaries(st.integers(0, 50).map(str), st.sampled_from([-100.0, 5.0]), max_size=3),
    "allowed_token_ids": st.lists(st.integers(0, 50), min_size=1, max_size=5),
    "bad_words": st.lists(_words.filter(bool), max_size=2), "stop_token_ids": st.lists(st.integers(0, 50), max_size=2),
    "guided_choice": st.lists(_words.filter(bool), min_size=1, max_size=3, unique=True),
    "response_format": st.just({"type": "json_object"}),
})
_chat = st.builds(lambda s, text, logprobs: {**s, "messages": [{"role": "user", "content": text}],
                                             **({"logprobs": True, "top_logprobs": 2} if logprobs else {})},
                  _sampling, st.text(max_size=40), st.booleans())
_completion = st.builds(lambda s, prompt, logprobs, echo: {**s, "prompt": prompt, "echo": echo,
                                                           **({"logprobs": 2} if logprobs else {})},
                        _sampling, st.one_of(st.text(min_size=1, max_size=40),
                                             st.lists(st.integers(0, 50), min_size=1, max_size=10)),
                        st.booleans(), st.booleans())


@given(route=st.sampled_from(["chat/completions", "completions"]), chat=_chat, completion=_completion)
@settings(max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_valid_shaped_generation_requests_are_answered_by_a_real_engine(real, route, chat, completion):
    import requests

    served, engine = real
    body = {"model": NAME, **(chat if route == "chat/completions" else completion)}
    r = requests.post(f"{served.url}/v1/{route}", json=body, timeout=120)
    assert r.status_code in (200, 400), (body, r.status_code, r.text[:500])
    if r.status_code == 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"], (body, err)
    elif body.get("stream"):
        assert not _stream_errors(r.text) and r.text.rstrip().endswith("data: [DONE]"), (body, r.text[-300:])
    else:
        answer = r.json()
        assert len(answer["choices"]) == body.get("n", 1) * (1 if route == "chat/completions" or
                                                             isinstance(body["prompt"], (str, list)) else 0)
    _assert_engine_idle(engine)
