"""Ingress admission bookkeeping (no Serve): a pending-request limit that can't leak."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from cluster.ingress import Ingress, OpenAIError, _bad_request


def _ingress(limit: int) -> Ingress:
    ing = object.__new__(Ingress)
    ing._pending, ing.max_pending = {}, limit
    return ing


def test_limit_is_503_with_retry_after_and_release_is_idempotent():
    ing = _ingress(3)
    a = ing._admit(2)
    ing._admit(1)
    with pytest.raises(OpenAIError) as e:
        ing._admit(1)
    assert e.value.status == 503 and e.value.headers["Retry-After"] == "1"
    ing._release(a)
    ing._release(a)
    assert ing.pending == 1


def test_a_stream_never_started_returns_its_admission_when_collected():
    ing = _ingress(1)
    token = ing._admit(1)

    async def chunks(merged):
        yield {}

    body = ing._sse([], chunks, token)
    weakref.finalize(body, ing._release, token)
    assert ing.pending == 1
    del body
    gc.collect()
    assert ing.pending == 0


def test_a_stream_run_to_the_end_returns_its_admission():
    ing = _ingress(1)
    token = ing._admit(1)

    async def chunks(merged):
        async for _ in merged:
            pass
        yield {"x": 1}

    async def drain():
        return [piece async for piece in ing._sse([_empty()], chunks, token)]

    pieces = asyncio.run(drain())
    assert pieces[-1] == "data: [DONE]\n\n" and ing.pending == 0


async def _empty():
    return
    yield


@pytest.mark.parametrize("message,param", [
    ("temperature must be >= 0, got -1", "temperature"),
    ("max_tokens must be <= 10 for this prompt", "max_tokens"),
    ("prompt is 900 tokens but max_model_len is 512", "messages"),
    ("logprobs must be an integer in [0, 20], got 30", "top_logprobs"),
    ("something unexpected", "messages"),
])
def test_engine_messages_map_to_the_openai_param(message, param):
    err = _bad_request(ValueError(message), prompt_param="messages", logprobs_param="top_logprobs")
    assert err.status == 400 and err.param == param and err.message == message
