"""Conditional disaggregation (cluster.pd.placement, through the ingress's cluster.http.runner), without Serve: the rule, a burst
split between the two queues, the in-flight counts on every way a request can end, and the
replica counts read from the Coordinator without ever waiting for it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from cluster.http.metrics import AppMetrics
from cluster.http.runner import RequestRunner
from cluster.pd.placement import LocalPrefillRule, PrefillPlacement, RoleCounts
from cluster.replica.errors import ReplicaError
from cluster.report import ReplicaReport
from cluster.roles import Role
from engine.load import EngineLoad
from engine.outputs import CompletionOutput, RequestOutput
from tests.cluster.helpers import engine_request, until


@pytest.mark.parametrize("rule,prompt_len,remote_each,local_each,local", [
    (LocalPrefillRule(0, 0), 100, 50.0, 0.0, False),  # off: every prompt disaggregated
    (LocalPrefillRule(2, 0), 100, 1.0, 0.0, False),  # prefill replicas not busy enough yet
    (LocalPrefillRule(2, 0), 100, 2.0, 0.0, True),  # busy, and the decode queue is shorter
    (LocalPrefillRule(2, 0), 100, 2.0, 2.0, False),  # equal queues: keep decode free of prompts
    (LocalPrefillRule(2, 0), 100, 3.0, 2.5, True),
    (LocalPrefillRule(0, 8), 8, 0.0, 0.0, True),  # short enough: local whatever the queues
    (LocalPrefillRule(0, 8), 9, 0.0, 0.0, False),
    (LocalPrefillRule(2, 8), 8, 0.0, 9.0, True),
])
def test_rule(rule, prompt_len, remote_each, local_each, local):
    assert rule.local(prompt_len, remote_each, local_each) is local


def _out(tag: str, token: int, finish: str | None = None, stop_reason=None) -> RequestOutput:
    return RequestOutput(tag, None, [1, 2], [CompletionOutput(0, "", [token], finish, stop_reason)],
                         finished=finish is not None, delta_token_ids=[token])


class _Gate:
    """Fake request halves: each waits for `release` before its first output (outputs named
    by their side: "remote" or "local")."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started: list[str] = []
        self.closed = 0  # halves whose cleanup ran (where a real one aborts its request)
        self.fail: set[str] = set()

    async def half(self, side: str):
        self.started.append(side)
        try:
            await self.release.wait()
            if side in self.fail:
                raise RuntimeError(f"{side} failed")
            yield _out(side, 1)
            yield _out(side, 2, "length")
        finally:
            self.closed += 1


def _runner(queue: int, prefill: int = 1, decode: int = 1, max_len: int = 0) -> tuple[RequestRunner, _Gate]:
    """The ingress's runner in P/D over the gate's halves: "local" is the decode engine,
    "remote" the disaggregated flow."""
    counts = {"prefill": prefill, "decode": decode}
    gate = _Gate()
    placement = PrefillPlacement(LocalPrefillRule(queue, max_len), counts.__getitem__)
    engines = SimpleNamespace(generate=lambda request: gate.half("local"))
    pd = SimpleNamespace(generate=lambda request, prefill_timeout_s: gate.half("remote"))
    return RequestRunner(engines, AppMetrics("m", "pd"), None, placement, pd), gate


def _stream(runner: RequestRunner, prompt_len: int = 100):
    return runner.stream(0, engine_request("r", range(prompt_len)))


def _sides(outs) -> list[str]:
    return [out.request_id for _, out in outs]


def test_a_burst_is_shared_between_the_two_queues_and_counts_return_to_zero():
    async def run():
        runner, gate = _runner(2)
        p = runner.placement
        gens = [_stream(runner) for _ in range(8)]
        firsts = [asyncio.ensure_future(g.__anext__()) for g in gens]
        await until(lambda: len(gate.started) == 8, "every request to start and wait at its gate")
        # Two on the prefill replica, then the shorter queue each time: 4 and 4.
        assert gate.started == ["remote", "remote", "local", "local", "remote", "local", "remote", "local"]
        assert p.in_flight == {"remote": 4, "local": 4}
        assert runner.metrics.registry.get_sample_value(
            "pdserve:local_prefills_total", {"model_name": "m", "mode": "pd"}) == 4
        gate.release.set()
        assert sorted(_sides(await asyncio.gather(*firsts))) == ["local"] * 4 + ["remote"] * 4
        assert p.in_flight == {"remote": 0, "local": 0}  # first token back: no longer in flight
        for g in gens:
            assert len([x async for x in g]) == 1
        assert p.in_flight == {"remote": 0, "local": 0}

    asyncio.run(run())


def test_queues_are_compared_per_replica():
    async def run():
        # Two prefill replicas: four prompts (two each) before the first local one.
        runner, gate = _runner(2, prefill=2, decode=1)
        gens = [_stream(runner) for _ in range(6)]
        firsts = [asyncio.ensure_future(g.__anext__()) for g in gens]
        await until(lambda: len(gate.started) == 6, "every request to start and wait at its gate")
        assert gate.started == ["remote"] * 4 + ["local", "local"]
        gate.release.set()
        await asyncio.gather(*firsts)
        for g in gens:
            await g.aclose()

    asyncio.run(run())


def test_a_request_leaving_or_failing_before_its_first_token_is_no_longer_counted():
    async def run():
        runner, gate = _runner(1)
        p = runner.placement
        left = _stream(runner)
        first = asyncio.ensure_future(left.__anext__())
        await until(lambda: gate.started == ["remote"], "the request to wait at its gate")
        assert p.in_flight["remote"] == 1
        first.cancel()  # the client goes away while its prompt is being prefilled
        with pytest.raises(asyncio.CancelledError):
            await first
        await left.aclose()
        assert p.in_flight["remote"] == 0 and gate.closed == 1  # its request closed with it, at once

        gate.fail = {"remote", "local"}
        failing = _stream(runner)
        gate.release.set()
        with pytest.raises(RuntimeError, match="remote failed"):
            await failing.__anext__()
        assert p.in_flight == {"remote": 0, "local": 0}
        gate.fail = set()

        reading = _stream(runner)
        assert _sides([await reading.__anext__()]) == ["remote"]
        await reading.aclose()  # the client goes away mid-stream
        assert gate.closed == 3  # its request closed at once, not when collected

        never_started = _stream(runner)
        assert p.in_flight["remote"] == 0  # decided and counted only when it starts
        await never_started.aclose()
        assert gate.started == ["remote", "remote", "remote"]

    asyncio.run(run())


def test_a_short_prompt_prefills_locally_with_the_prefill_replicas_idle():
    async def run():
        runner, gate = _runner(0, max_len=16)
        gate.release.set()
        assert _sides([x async for x in _stream(runner, 16)]) == ["local", "local"]
        assert _sides([x async for x in _stream(runner, 17)]) == ["remote", "remote"]

    asyncio.run(run())


class _Coordinator:
    """A Coordinator handle whose `replicas.remote()` answers what `board` holds (or raises)."""

    def __init__(self, board) -> None:
        self.board = board
        self.calls = 0
        self.replicas = self

    def remote(self):
        self.calls += 1

        async def answer():
            if isinstance(self.board, Exception):
                raise self.board
            return [ReplicaReport(f"{role}-{i}", Role.of(role), EngineLoad()) for i, role in enumerate(self.board)]
        return answer()


def test_role_counts_refresh_in_the_background_and_survive_a_coordinator_failure():
    async def run():
        coordinator = _Coordinator(["prefill", "prefill", "decode"])
        counts = RoleCounts(coordinator, period_s=3600)
        assert counts("prefill") == 1  # not waited for: one until the Coordinator answers
        await counts._refreshing
        assert (counts("prefill"), counts("decode"), counts("colocated")) == (2, 1, 1)
        assert counts._refreshing.done() and coordinator.calls == 1  # not asked again within the period
        coordinator.board = ["decode", "decode", "decode"]
        counts.period_s = 0
        counts("decode")
        await counts._refreshing
        assert (counts("prefill"), counts("decode")) == (1, 3)  # none reporting counts as one
        coordinator.board = RuntimeError("coordinator restarting")
        await counts._refreshing  # the refresh the line above started
        assert counts("decode") == 3  # the last counts stay
        assert coordinator.calls == 3

    asyncio.run(run())


def test_a_coordinator_that_never_answers_is_given_up_and_asked_again(monkeypatch):
    import cluster.pd.placement as placement

    monkeypatch.setattr(placement, "COUNTS_TIMEOUT_S", 0.01)

    class Silent:
        calls = 0

        def __init__(self) -> None:
            self.replicas = self

        def remote(self):
            Silent.calls += 1
            return asyncio.Event().wait()  # never answers

    async def run():
        counts = RoleCounts(Silent(), period_s=0)
        assert counts("prefill") == 1
        await counts._refreshing  # ends by its timeout, not by an answer
        assert counts("prefill") == 1 and Silent.calls == 1
        await counts._refreshing  # the next decision asked again
        assert Silent.calls == 2

    asyncio.run(run())


def test_an_engine_failure_on_a_plain_request_is_an_error_as_on_the_disaggregated_path():
    async def run():
        outs = [_out("r", 5), _out("r", 6, "length")]
        ok, _ = _plain(outs)
        assert [o.delta_token_ids for _, o in [x async for x in ok.stream(0, engine_request())]] == [[5], [6]]
        failing, closed = _plain([_out("r", 5), _out("r", 0, "error", "grammar failed to compile")])
        with pytest.raises(ReplicaError, match="grammar failed"):
            async for _ in failing.stream(0, engine_request()):
                pass
        assert closed == [True]
        left, closed = _plain([_out("r", 5), _out("r", 6), _out("r", 7, "length")])
        gen = left.stream(0, engine_request())
        await gen.__anext__()
        await gen.aclose()
        assert closed == [True]  # closed with it, at once

    asyncio.run(run())


def _plain(outs) -> tuple[RequestRunner, list]:
    """A colocated runner whose engine replays `outs`; the list notes its stream's close."""
    closed = []

    async def generate(request):
        try:
            for out in outs:
                yield out
        finally:
            closed.append(True)

    return RequestRunner(SimpleNamespace(generate=generate), AppMetrics("m", "colocated")), closed
