"""The contract of the request path (docs/architecture.md#the-path-of-one-request): a request
is processed once, at the ingress, into the EngineRequest every engine runs as it is; each
streamed token climbs at most five async-generator frames of the project in the ingress.
In one process, without Serve: the ingress's own route and runner over stand-in or real
engines."""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import sys
import threading
from types import SimpleNamespace

import pytest

from cluster.http import openai_format as fmt
from cluster.http.chat import chat_job
from cluster.http.metrics import AppMetrics
from cluster.http.protocol import ChatCompletionRequest
from cluster.http.runner import RequestRunner
from cluster.http.served_model import ServedModel
from cluster.pd.flow import pd_flow
from cluster.pd.placement import LocalPrefillRule, PrefillPlacement
from cluster.pd.serve_peers import ServePD
from engine import AsyncLLM, EngineArgs
from engine.llm_engine import load_processor
from engine.outputs import CompletionOutput, RequestOutput
from engine.processor import InputProcessor
from tests.cluster.helpers import RecordingStore
from tests.cluster.ingress_harness import make_ingress

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Where the project's own code lives (its frames are the ones counted).
PROJECT = tuple(os.path.join(ROOT, p) + os.sep for p in ("cluster", "engine", "kvstore", "actors"))
MAX_FRAMES = 5


def _async_generator_frames() -> list[str]:
    """The async-generator frames on the stack above the caller's (an engine's stream, which
    counts as AsyncLLM.generate does), the caller's included: the project's own, and Starlette
    or asyncio excluded (they are not the ingress's code)."""
    stack = inspect.stack()[1:]
    return [f"{os.path.relpath(f.filename, ROOT)}:{f.function}" for i, f in enumerate(stack)
            if f.frame.f_code.co_flags & inspect.CO_ASYNC_GENERATOR and (i == 0 or f.filename.startswith(PROJECT))]


class _CountingEngine:
    """A decode engine (an EngineClient) that notes, at each output it yields, the project's
    async-generator frames above it: what each token climbs."""

    def __init__(self) -> None:
        self.depths: list[list[str]] = []

    async def generate(self, request):
        ids = []
        for k in range(3):
            ids.append(7 + k)
            self.depths.append(_async_generator_frames())
            yield RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                                [CompletionOutput(0, "x" * len(ids), list(ids), "length" if k == 2 else None)],
                                finished=k == 2, delta_text="x", delta_token_ids=[ids[-1]])


class _Prefill:
    """A Prefill deployment handle that answers each prefill with its first token at once."""

    def __init__(self) -> None:
        self.prefill = self

    def remote(self, request):
        async def answer():
            return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                                 [CompletionOutput(0, "x", [6], "length")], finished=True, delta_text="x",
                                 delta_token_ids=[6])
        return answer()


def _chat(stream: bool = True) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "stream": stream, "max_tokens": 4, "temperature": 0,
                                                 "messages": [{"role": "user", "content": "Name a river."}]})


@pytest.mark.parametrize("mode", ["colocated", "pd"])
def test_each_streamed_token_climbs_at_most_five_async_generator_frames_in_the_ingress(tiny_model, mode):
    ing = make_ingress(tiny_model)
    engine = _CountingEngine()
    runner = RequestRunner(engine, ing.metrics)
    if mode == "pd":  # the default: every prompt of more than a few tokens to a prefill replica
        placement = PrefillPlacement(LocalPrefillRule(), lambda role: 1)
        runner = RequestRunner(engine, ing.metrics, None, placement,
                               ServePD(_Prefill(), engine, RecordingStore(), "recompute"))
    ing.runner = runner

    async def run():
        response = await ing.respond(chat_job(ing.served, _chat()))
        return [piece async for piece in response.body_iterator]

    pieces = asyncio.run(asyncio.wait_for(run(), 60))
    assert pieces[-1] == fmt.sse("[DONE]") and len(engine.depths) == 3
    for frames in engine.depths:
        assert len(frames) <= MAX_FRAMES, frames
    # The counted frames are the path's: the SSE writer, the route's chunks, the runner, (the
    # P/D flow,) the engine's stream.
    assert any(f.endswith("runner.py:stream") for f in engine.depths[0])
    assert any(f.endswith("flow.py:pd_flow") for f in engine.depths[0]) is (mode == "pd")


class _LocalPeers:
    """pd_flow's peers as two engines in this process (no KV transfer: the decode engine
    computes the prompt, whose answer is the same)."""

    def __init__(self, prefill: AsyncLLM, decode: AsyncLLM) -> None:
        self.prefill_engine, self.decode_engine = prefill, decode

    async def prefill(self, request):
        last = None
        async for out in self.prefill_engine.generate(request):
            last = out
        return last

    def decode(self, request):
        return self.decode_engine.generate(request)

    async def cleanup(self, request_id, transfer_id, unfinished):
        if unfinished:
            await asyncio.gather(self.prefill_engine.abort(request_id), self.decode_engine.abort(request_id))


class _Tracer:
    """The project's source files whose code runs while `on`, in this thread and in the
    threads started while it was installed (the engines' busy loops)."""

    def __init__(self) -> None:
        self.on, self.files = False, set()

    def __call__(self, frame, event, arg) -> None:
        if self.on:
            path = frame.f_code.co_filename
            if path.startswith(PROJECT):
                self.files.add(os.path.relpath(path, ROOT))

    def __enter__(self):
        self.on = True
        sys.setprofile(self)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
        self.on = False


@pytest.fixture(scope="module")
def engines(tiny_model):
    """(ServedModel, prefill, decode, colocated engines, tracer): three engines of the tiny
    model in this process, their threads started under the tracer."""
    args = EngineArgs(tiny_model, max_model_len=128, num_kv_blocks=64)
    tokenizer, processor = load_processor(args.create_engine_config())
    served = ServedModel("m", tiny_model, tokenizer, processor, fmt.TokenText(tokenizer))
    tracer = _Tracer()
    threading.setprofile(tracer)
    try:
        made = [AsyncLLM.from_engine_args(args) for _ in range(3)]
    finally:
        threading.setprofile(None)
    yield (served, *made, tracer)
    for engine in made:
        engine.shutdown()


def _pd_runner(prefill: AsyncLLM, decode: AsyncLLM) -> RequestRunner:
    peers = _LocalPeers(prefill, decode)
    return RequestRunner(SimpleNamespace(generate=None), AppMetrics("m", "pd"), None,
                         PrefillPlacement(LocalPrefillRule(), lambda role: 1),
                         SimpleNamespace(generate=lambda request, prefill_timeout_s: pd_flow(peers, request, "recompute")))


async def _answer(job, runner) -> list[int]:
    outs = [out async for _, out in runner.stream(0, job.requests[0])]
    return list(outs[-1].outputs[0].token_ids)


def test_a_pd_request_is_processed_once_at_the_ingress_and_only_checked_by_both_engines(engines, monkeypatch):
    served, prefill, decode, colocated, _ = engines
    processed, checked = [], []
    process, check = InputProcessor.process, InputProcessor.check
    monkeypatch.setattr(InputProcessor, "process", lambda self, *a, **k: processed.append(self) or process(self, *a, **k))
    monkeypatch.setattr(InputProcessor, "check", lambda self, request: checked.append(self) or check(self, request))
    job = chat_job(served, _chat(stream=False))
    assert processed == [served.processor]  # the route built the request: once
    split = asyncio.run(asyncio.wait_for(_answer(job, _pd_runner(prefill, decode)), 120))
    assert processed == [served.processor]  # neither engine processed it again ...
    assert {id(p) for p in checked} >= {id(prefill.engine.processor), id(decode.engine.processor)}  # ... both checked it
    whole = asyncio.run(asyncio.wait_for(_answer(job, RequestRunner(colocated, AppMetrics("m", "colocated"))), 120))
    assert split == whole and len(split) == 4  # and the split request's answer is the whole one's


def _path_files() -> set[str]:
    """The files docs/architecture.md#the-path-of-one-request names in its path block."""
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        text = f.read()
    section = text.split("## The path of one request", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    return set(re.findall(r"\b(?:cluster|engine|kvstore|actors|kernels)/[\w/]+\.(?:py|c)\b", block))


def test_the_documented_path_names_every_file_a_request_runs_and_only_real_ones(engines):
    """What a chat request runs in one process (the ingress's route and runner, the P/D flow,
    both engines' front ends and cores) is on the documented path, file by file; the doc's
    other files (the Serve hops, the core process, the KV transfer) exist."""
    served, prefill, decode, _, tracer = engines
    job = chat_job(served, _chat(stream=True))
    runner = _pd_runner(prefill, decode)

    async def stream():
        return [piece async for piece in job.chunks(runner.stream(0, job.requests[0]))]

    with tracer:
        pieces = asyncio.run(asyncio.wait_for(stream(), 120))
    documented = _path_files()
    assert pieces and tracer.files
    assert not sorted(tracer.files - documented), "run by a request, not on the documented path"
    assert not sorted(p for p in documented if not os.path.exists(os.path.join(ROOT, p)))
