"""Ingress admission bookkeeping (no Serve): a pending-request limit that can't leak; and the
one path from a ParameterError to an OpenAI 400 naming the request's field."""

from __future__ import annotations

import asyncio
import gc
import weakref
from types import SimpleNamespace

import pytest

from cluster.http.errors import OpenAIError, rejecting
from cluster.http.ingress import Ingress
from cluster.http.protocol import ChatCompletionRequest, CompletionRequest
from cluster.http.runner import RequestRunner
from cluster.http.served_model import Job
from engine.errors import ParameterError
from tests.cluster.helpers import engine_request


def _ingress(limit: int) -> Ingress:
    ing = object.__new__(Ingress)
    ing._pending, ing.max_pending = {}, limit
    ing._pusher = None
    ing.served = SimpleNamespace(loras=None)  # no LoRA adapters (cluster.http.lora)
    return ing


def test_limit_is_429_with_retry_after_and_release_is_idempotent():
    ing = _ingress(3)
    a = ing._admit(2)
    ing._admit(1)
    with pytest.raises(OpenAIError) as e:
        ing._admit(1)
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"
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


CHAT = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
CHAT_MCT = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], max_completion_tokens=3)
COMPLETION = CompletionRequest(model="m", prompt="x")


@pytest.mark.parametrize("body,field,param", [
    (CHAT, "temperature", "temperature"),
    (CHAT, "max_tokens", "max_tokens"),
    (CHAT_MCT, "max_tokens", "max_completion_tokens"),
    (CHAT, "prompt", "messages"),
    (CHAT, "logprobs", "top_logprobs"),
    (COMPLETION, "prompt", "prompt"),
    (COMPLETION, "logprobs", "logprobs"),
    (COMPLETION, "stop_token_ids", "stop_token_ids"),
])
def test_parameter_errors_are_400_naming_the_request_field(body, field, param):
    with pytest.raises(OpenAIError) as exc, rejecting(body):
        raise ParameterError(field, f"{field} is out of range")
    err = exc.value
    assert err.status == 400 and err.param == param and err.message == f"{field} is out of range"
    assert isinstance(err.__cause__, ParameterError)


def test_other_errors_pass_through_rejecting():
    with pytest.raises(KeyError), rejecting(COMPLETION):
        raise KeyError("not a validation error")


def test_a_request_stream_closes_its_request_when_it_is_closed_and_counts_it_cancelled():
    from cluster.http.metrics import AppMetrics
    from engine.outputs import CompletionOutput, RequestOutput

    closed = []

    async def generate(request):
        try:
            for t in range(3):
                yield RequestOutput("r", None, [1], [CompletionOutput(0, "", [t])], finished=False,
                                    delta_token_ids=[t])
        finally:
            closed.append(True)  # where a real request aborts itself on its replicas

    async def run():
        metrics = AppMetrics("m", "pd")
        stream = RequestRunner(SimpleNamespace(generate=generate), metrics).stream(0, engine_request())
        await stream.__anext__()
        await stream.aclose()  # the client goes away mid-stream
        assert closed == [True]  # at once, not when the request's generator is collected
        assert b'pdserve:requests_total{mode="pd",model_name="m",status="cancelled"} 1.0' in metrics.render([])

    asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True])
def test_a_colocated_engine_failure_is_a_503_never_a_200_with_a_partial_answer(stream):
    """The engine replica ends a request with finish_reason "error" (a data-parallel core could
    not take it): in colocated mode the client gets a 503 in OpenAI's error shape (streamed:
    an error event), as in P/D mode, not a 200 whose answer stops short."""
    import json

    from cluster.http.metrics import AppMetrics
    from cluster.http.openai_models import CompletionChoice, CompletionChunk
    from engine.outputs import CompletionOutput, RequestOutput

    class Streams:
        async def generate(self, request):
            request_id = request.request_id
            yield RequestOutput(request_id, None, [1], [CompletionOutput(0, "a", [5])], finished=False,
                                delta_token_ids=[5])
            yield RequestOutput(request_id, None, [1], [CompletionOutput(0, "a", [5], finish_reason="error",
                                                                         stop_reason="core 1 failed")],
                                finished=True)

    ing = _ingress(4)
    ing.mode, ing.metrics = "colocated", AppMetrics("m", "colocated")
    ing.runner = RequestRunner(Streams(), ing.metrics)

    async def chunks(merged):
        async for _, out in merged:
            yield CompletionChunk(id="r", created=0, model="m", choices=[
                CompletionChoice(index=0, text=out.outputs[0].text, logprobs=None, finish_reason=None)])

    async def run():
        response = await ing.respond(Job([engine_request("r", [1])], "r", stream, chunks, lambda finals: {}))
        events = [e async for e in response.body_iterator]
        return events

    if not stream:
        with pytest.raises(OpenAIError) as e:
            asyncio.run(run())
        assert e.value.status == 503 and "core 1 failed" in e.value.message
    else:
        events = asyncio.run(run())
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and "core 1 failed" in error["message"] and events[-1] == "data: [DONE]\n\n"
    assert ing.pending == 0


class _HungCoordinator:
    """Every call waits until `release` is set (a Coordinator being replaced: Serve holds calls
    to a deployment with no running replica); `finished` lists the calls that ran to the end."""

    def __init__(self):
        self.release = asyncio.Event()
        self.finished: list[str] = []

    def __getattr__(self, method):
        hung = self

        class _Method:
            def remote(self, *args):
                async def call():
                    await hung.release.wait()
                    hung.finished.append(method)
                    return (202, {}) if method == "scale" else {}
                return call()

        return _Method()


def test_a_hung_coordinator_is_a_503_within_the_bound_and_a_scale_is_not_cut_short():
    from cluster.http.metrics import AppMetrics

    ing = _ingress(4)
    ing.coordinator_call_s = 0.05
    ing.coordinator, ing.mode, ing.ingress_id = _HungCoordinator(), "colocated", "ingress-x"
    ing.metrics = AppMetrics("m", "colocated")
    ing._share_coordinator_calls()

    class Body:
        async def json(self):
            return {"colocated": 2}

    async def run():
        for call in (ing.health(), ing.status(), ing.metrics_text()):
            with pytest.raises(OpenAIError) as e:
                await asyncio.wait_for(call, 30)  # the test's own bound; the route's is 0.05 s
            assert e.value.status == 503 and "coordinator unavailable: TimeoutError" in e.value.message
            assert e.value.headers["Retry-After"]
        with pytest.raises(OpenAIError) as e:
            await asyncio.wait_for(ing._ask_coordinator("scale", {}, timeout_s=0.05), 30)
        assert e.value.status == 503
        ing.coordinator.release.set()
        for _ in range(100):  # the shielded calls finish once the coordinator answers
            if "scale" in ing.coordinator.finished:
                break
            await asyncio.sleep(0.01)
        assert "scale" in ing.coordinator.finished

    asyncio.run(run())
