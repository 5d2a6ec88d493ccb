"""EngineServer's health check and load report, on a stand-in engine (no Serve needed)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from cluster.replica.latency import LatencyWindow
from cluster.replica.server import EngineServer
from cluster.roles import Role
from engine.load import EngineLoad
from tests.cluster.helpers import engine_request


class _Engine:
    """The part of cluster.replica.host.ServingEngine a replica's health and figures use."""

    def __init__(self, errored=None):
        self.errored = errored
        self.running = 3

    async def check_health(self):
        if self.errored is not None:
            raise RuntimeError(f"the engine thread failed: {self.errored!r}")

    async def load(self):
        return EngineLoad(waiting=2, running=self.running, free_blocks=10, total_blocks=16)

    def rank_actors(self):
        return []

    async def kv_transfer_stats(self):
        return {}


class _Coordinator:
    def __init__(self):
        self.reports = []

        class _Report:
            @staticmethod
            def remote(figures):
                self.reports.append(figures)

        self.report = _Report()


def _server(errored=None, coordinator=None) -> EngineServer:
    server = object.__new__(EngineServer)
    server.engine, server.role, server.replica_id = _Engine(errored), Role.DECODE, "decode-x"
    server.connectors, server.relay, server.transport = {}, None, None
    server._coordinator, server._seq = coordinator, 0
    server._forwarded, server._forwarded_at = None, 0.0
    server.ttft, server.itl = LatencyWindow(), LatencyWindow()
    server._observers, server.stream_interval_s = {}, 0.0
    return server


def test_check_health_fails_when_the_engine_thread_died():
    asyncio.run(_server().check_health())
    with pytest.raises(RuntimeError, match="engine of decode-x failed"):
        asyncio.run(_server(errored=ValueError("boom")).check_health())


def test_check_health_fails_when_the_kv_relay_of_its_core_process_stopped():
    class _Relay:
        alive = True

    server = _server()
    server.relay = _Relay()
    asyncio.run(server.check_health())
    _Relay.alive = False  # its core's transfers would all fail from now on
    with pytest.raises(RuntimeError, match="KV relay of decode-x"):
        asyncio.run(server.check_health())


def test_routing_stats_carry_load_and_a_fresh_sequence_number_and_reach_the_coordinator():
    coordinator = _Coordinator()
    server = _server(coordinator=coordinator)
    a = asyncio.run(server.record_routing_stats())
    b = asyncio.run(server.record_routing_stats())
    assert a == {"waiting": 2, "running": 3, "seq": a["seq"], "loras": []}  # what Serve's routers read
    assert b["seq"] == a["seq"] + 1  # routers reset their sent-since-report count on a new seq
    # The coordinator hears only of changes (and a heartbeat, when nothing changes for a while).
    assert [r.seq for r in coordinator.reports] == [a["seq"]]
    first = coordinator.reports[0]
    assert (first.replica, first.role, first.engine.waiting, first.engine.running) == ("decode-x", "decode", 2, 3)
    server.engine.running = 4
    c = asyncio.run(server.record_routing_stats())
    assert [r.seq for r in coordinator.reports] == [a["seq"], c["seq"]]
    server._forwarded_at -= 60  # as if the last report were a minute old
    d = asyncio.run(server.record_routing_stats())
    assert [r.seq for r in coordinator.reports] == [a["seq"], c["seq"], d["seq"]]
    assert first.kv_transfer == {}  # no connector on this stand-in


def test_an_engine_that_fails_under_an_in_process_caller_is_a_503_with_retry_after():
    """A direct-streaming ingress calls its EngineServer in process: an engine failure there
    (EngineDeadError from AsyncLLM) must reach the client as a 503, as a routed replica's
    does, never as a 500 or a partial 200."""
    from cluster.http.errors import replica_error
    from engine.errors import EngineDeadError

    FIRST = SimpleNamespace(delta_token_ids=[7])

    class _DeadEngine:
        async def generate(self, request, observe=None, stream_interval_s=0.0):
            yield FIRST
            raise EngineDeadError("engine failed: EngineDeadError('the engine core process exited')")

    server = _server()
    server.engine = _DeadEngine()

    async def run():
        got = []
        with pytest.raises(EngineDeadError) as e:
            async for out in server.generate(engine_request()):
                got.append(out)
        return got, e.value

    got, error = asyncio.run(run())
    assert got == [FIRST] and "exited" in str(error)
    answer = replica_error(error)
    assert answer.status == 503 and answer.headers["Retry-After"]


def test_an_in_process_caller_feeds_the_latency_windows_per_engine_step_not_per_output_it_reads():
    """A direct-streaming ingress that fell behind reads several engine steps as one output
    (AsyncLLM merges them); the replica's ITL window (autoscaling's signal) still sees one gap
    per step, as a routed replica's per-step channel does."""
    steps = [SimpleNamespace(request_id="r", delta_token_ids=[t], finished=t == 3) for t in (1, 2, 3)]

    class _Engine:
        async def generate(self, request, observe=None, stream_interval_s=0.0):
            for out in steps:  # three engine steps arrive while the caller is busy ...
                observe(out)
            yield steps[-1]  # ... and it reads them as one output

    server = _server()
    server.engine = _Engine()

    async def run():
        return [out async for out in server.generate(engine_request())]

    assert asyncio.run(run()) == [steps[-1]]
    assert len(server.itl._samples) == 2 and server._observers == {}  # gaps 1-2 and 2-3; nothing left behind
