"""EngineServer's health check and load report, on a stand-in worker (no Serve needed)."""

from __future__ import annotations

import asyncio

import pytest

from actors.worker import EngineWorker
from cluster.replica.latency import LatencyWindow
from cluster.replica.server import EngineServer


class _Engine:
    def __init__(self, errored=None):
        self._errored = errored
        self.running = 3

    async def load(self):
        return {"waiting": 2, "running": self.running, "free_blocks": 10, "total_blocks": 16, "kv_usage": 0.375,
                "prefix_cache_hit_rate": 0.5}


class _Coordinator:
    def __init__(self):
        self.reports = []

        class _Report:
            @staticmethod
            def remote(figures):
                self.reports.append(figures)

        self.report = _Report()


def _server(errored=None, coordinator=None) -> EngineServer:
    worker = object.__new__(EngineWorker)
    worker.engine, worker.replica_id, worker.role = _Engine(errored), "decode-x", "decode"
    worker.connectors, worker.relay, worker.transport = {}, None, None
    server = object.__new__(EngineServer)
    server.worker, server.role, server.replica_id = worker, "decode", "decode-x"
    server._coordinator, server._seq = coordinator, 0
    server._forwarded, server._forwarded_at = None, 0.0
    server.ttft, server.itl = LatencyWindow(), LatencyWindow()
    return server


def test_check_health_fails_when_the_engine_thread_died():
    asyncio.run(_server().check_health())
    with pytest.raises(RuntimeError, match="engine of decode-x failed"):
        asyncio.run(_server(errored=ValueError("boom")).check_health())


def test_check_health_fails_when_the_kv_relay_of_its_core_process_stopped():
    class _Relay:
        alive = True

    server = _server()
    server.worker.relay = _Relay()
    asyncio.run(server.check_health())
    _Relay.alive = False  # its core's transfers would all fail from now on
    with pytest.raises(RuntimeError, match="KV relay of decode-x"):
        asyncio.run(server.check_health())


def test_routing_stats_carry_load_and_a_fresh_sequence_number_and_reach_the_coordinator():
    coordinator = _Coordinator()
    server = _server(coordinator=coordinator)
    a = asyncio.run(server.record_routing_stats())
    b = asyncio.run(server.record_routing_stats())
    assert (a["waiting"], a["running"], a["role"], a["replica"]) == (2, 3, "decode", "decode-x")
    assert b["seq"] == a["seq"] + 1  # routers reset their sent-since-report count on a new seq
    # The coordinator hears only of changes (and a heartbeat, when nothing changes for a while).
    assert [r["seq"] for r in coordinator.reports] == [a["seq"]]
    server.worker.engine.running = 4
    c = asyncio.run(server.record_routing_stats())
    assert [r["seq"] for r in coordinator.reports] == [a["seq"], c["seq"]]
    server._forwarded_at -= 60  # as if the last report were a minute old
    d = asyncio.run(server.record_routing_stats())
    assert [r["seq"] for r in coordinator.reports] == [a["seq"], c["seq"], d["seq"]]
    assert a["kv_transfer"] == {}  # no connector on this stand-in
