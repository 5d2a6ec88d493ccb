"""DPEngineClient over cores that are threads (a stand-in backend): routing, per-step
outputs, waves relayed between cores, figures, and a dead core failing the group. The
real backends (processes, Ray actors) are tests/engine/test_data_parallel.py and
tests/actors/test_data_parallel_ray.py."""

from __future__ import annotations

import time

import pytest

from engine import EngineArgs, SamplingParams
from engine.core_client.messages import CoreFailed, CoreStep, StartWave
from engine.dp import client as client_module
from engine.dp.client import DPEngineClient
from engine.errors import EngineDeadError
from engine.request import Request
from engine.sched.output import EngineCoreOutput
from tests.engine.dp_standins import ThreadCores


def _client(model: str, monkeypatch, **parallel) -> DPEngineClient:
    monkeypatch.setattr(client_module, "dp_backend", lambda name: ThreadCores)
    config = EngineArgs(model=model, data_parallel_size=2, **parallel).create_engine_config()
    return DPEngineClient(config)


def _request(rid: str) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=1), 1)


def _run(client: DPEngineClient, ids: list[str]) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    deadline = time.monotonic() + 30
    while len(done) < len(ids):
        assert time.monotonic() < deadline
        for out in client.step():
            if out.finished:
                done[out.request_id] = out.new_token_ids
    return done


def test_requests_spread_over_the_cores_and_each_output_comes_back_once(model_factory, monkeypatch):
    client = _client(model_factory("llama"), monkeypatch)
    try:
        ids = [f"r{i}" for i in range(6)]
        for rid in ids:
            client.add_request(_request(rid))
        assert _run(client, ids) == {rid: [7] for rid in ids}
        assert not client.has_unfinished_requests()
        per_core = [len(c.left) == 0 for c in client.cores.cores]
        assert per_core == [True, True]
        # The copies the cores sent with their steps say what asking them says.
        deadline = time.monotonic() + 10
        while client.load(fresh=False).data_parallel != client.load().data_parallel:
            assert time.monotonic() < deadline
            client.step()
        assert [c.requests for c in client.load().data_parallel] == [3, 3]
        assert [c.dummy_steps for c in client.load().data_parallel] == [0, 0]  # not lockstep
    finally:
        client.shutdown()


def test_a_request_while_the_cores_are_paused_starts_a_wave_on_both(model_factory, monkeypatch):
    client = _client(model_factory("qwen3_moe"), monkeypatch, enable_expert_parallel=True)
    try:
        client.add_request(_request("a"))
        assert _run(client, ["a"]) == {"a": [7]}
        sent = client.cores.sent
        assert isinstance(sent[0][0], StartWave) and isinstance(sent[1][0], StartWave)
        deadline = time.monotonic() + 10
        while client.coordinator.cores_running:  # the cores find no work and end the wave
            assert time.monotonic() < deadline
            client.step()
        assert client.coordinator.wave == 1
        idle = 1 if sent[0][1:] else 0
        assert client.cores.loops[idle].dummy_steps >= ThreadCores.steps  # it stepped with the busy core
        client.add_request(_request("b"))  # the next wave
        assert _run(client, ["b"]) == {"b": [7]}
        assert [m.wave for m in sent[1 - idle] if isinstance(m, StartWave)][-1] == 1
    finally:
        client.shutdown()


def test_a_core_that_fails_fails_the_group_and_every_later_call(model_factory, monkeypatch):
    client = _client(model_factory("llama"), monkeypatch)
    try:
        client._inbox.put(CoreFailed(1, "Traceback: boom"))
        with pytest.raises(EngineDeadError, match="data-parallel core 1 failed:\nTraceback: boom"):
            client.step()
        with pytest.raises(EngineDeadError):
            client.add_request(_request("late"))
        assert not any(t.is_alive() for t in client.cores.threads)  # stopped with the group
    finally:
        client.shutdown()


def test_an_output_for_a_request_aborted_meanwhile_is_dropped(model_factory, monkeypatch):
    client = _client(model_factory("llama"), monkeypatch)
    try:
        client.add_request(_request("x"))
        client.abort_requests(["x"])
        # The core had already stepped it when the abort arrived: its output is on the way.
        client._inbox.put(CoreStep(0, [EngineCoreOutput("x", [7], finish_reason="length")], 0, 0))
        assert client.step() == [] and not client.has_unfinished_requests()
    finally:
        client.shutdown()
