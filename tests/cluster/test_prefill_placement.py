"""Conditional disaggregation (cluster.http.pd_serve), without Serve: the rule, a burst
split between the two queues, the in-flight counts on every way a request can end, and the
replica counts read from the Coordinator without ever waiting for it."""

from __future__ import annotations

import asyncio

import pytest

from actors.report import ReplicaReport
from actors.roles import Role
from cluster.http.pd_serve import LocalPrefillRule, PrefillPlacement, RoleCounts
from engine.load import EngineLoad
from tests.cluster.helpers import until


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


class _Gate:
    """Fake request halves: each waits for `release` before its first output."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started: list[str] = []
        self.closed = 0  # halves whose cleanup ran (where a real one aborts its request)

    def half(self, side: str, fail: bool = False):
        async def gen(*_timeout_s):  # the remote half is given its prefill bound
            self.started.append(side)
            try:
                await self.release.wait()
                if fail:
                    raise RuntimeError(f"{side} failed")
                yield f"{side}-first"
                yield f"{side}-last"
            finally:
                self.closed += 1
        return gen


def _placement(queue: int, prefill: int = 1, decode: int = 1, max_len: int = 0) -> PrefillPlacement:
    counts = {"prefill": prefill, "decode": decode}
    return PrefillPlacement(LocalPrefillRule(queue, max_len), counts.__getitem__)


def test_a_burst_is_shared_between_the_two_queues_and_counts_return_to_zero():
    async def run():
        p, gate = _placement(2), _Gate()
        locals_seen = []
        gens = [p.run(100, gate.half("remote"), gate.half("local"), lambda: locals_seen.append(1))
                for _ in range(8)]
        firsts = [asyncio.ensure_future(g.__anext__()) for g in gens]
        await until(lambda: len(gate.started) == 8, "every request to start and wait at its gate")
        # Two on the prefill replica, then the shorter queue each time: 4 and 4.
        assert gate.started == ["remote", "remote", "local", "local", "remote", "local", "remote", "local"]
        assert p.in_flight == {"remote": 4, "local": 4} and len(locals_seen) == 4
        gate.release.set()
        assert sorted(await asyncio.gather(*firsts)) == ["local-first"] * 4 + ["remote-first"] * 4
        assert p.in_flight == {"remote": 0, "local": 0}  # first token back: no longer in flight
        for g in gens:
            assert [x async for x in g] in (["local-last"], ["remote-last"])
        assert p.in_flight == {"remote": 0, "local": 0}

    asyncio.run(run())


def test_queues_are_compared_per_replica():
    async def run():
        # Two prefill replicas: four prompts (two each) before the first local one.
        p, gate = _placement(2, prefill=2, decode=1), _Gate()
        gens = [p.run(100, gate.half("remote"), gate.half("local")) for _ in range(6)]
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
        p, gate = _placement(1), _Gate()
        left = p.run(100, gate.half("remote"), gate.half("local"))
        first = asyncio.ensure_future(left.__anext__())
        await until(lambda: gate.started == ["remote"], "the request to wait at its gate")
        assert p.in_flight["remote"] == 1
        first.cancel()  # the client goes away while its prompt is being prefilled
        with pytest.raises(asyncio.CancelledError):
            await first
        await left.aclose()
        assert p.in_flight["remote"] == 0 and gate.closed == 1  # its request closed with it, at once

        failing = p.run(100, gate.half("remote", fail=True), gate.half("local", fail=True))
        gate.release.set()
        with pytest.raises(RuntimeError, match="remote failed"):
            await failing.__anext__()
        assert p.in_flight == {"remote": 0, "local": 0}

        reading = p.run(100, gate.half("remote"), gate.half("local"))
        assert await reading.__anext__() == "remote-first"
        await reading.aclose()  # the client goes away mid-stream
        assert gate.closed == 3  # its request closed at once, not when collected

        never_started = p.run(100, gate.half("remote"), gate.half("local"))
        assert p.in_flight["remote"] == 0  # decided and counted only when it starts
        await never_started.aclose()
        assert gate.started == ["remote", "remote", "remote"]

    asyncio.run(run())


def test_a_short_prompt_prefills_locally_with_the_prefill_replicas_idle():
    async def run():
        p, gate = _placement(0, max_len=16), _Gate()
        gate.release.set()
        assert [x async for x in p.run(16, gate.half("remote"), gate.half("local"))] == ["local-first", "local-last"]
        assert [x async for x in p.run(17, gate.half("remote"), gate.half("local"))] == ["remote-first", "remote-last"]

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
    import cluster.http.pd_serve as placement

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


def _out(token: int, finish: str | None = None, stop_reason=None):
    from engine.outputs import CompletionOutput, RequestOutput

    return RequestOutput("r", None, [1, 2], [CompletionOutput(0, "", [token], finish, stop_reason)],
                         finished=finish is not None, delta_token_ids=[token])


class _Streams:
    """A decode deployment's ReplicaStreams that replays `outs`, noting when it is closed."""

    def __init__(self, outs) -> None:
        self.outs, self.closed = outs, False

    async def generate(self, prompt, params, request_id):
        try:
            for out in self.outs:
                yield out
        finally:
            self.closed = True


def test_an_engine_failure_on_a_plain_request_is_an_error_as_on_the_disaggregated_path():
    from cluster.http.pd_serve import serve_plain_generate
    from kvstore.pd import PDRequestError

    async def run():
        ok = _Streams([_out(5), _out(6, "length")])
        assert [o.delta_token_ids for o in [x async for x in serve_plain_generate(ok, {}, None, "r")]] == [[5], [6]]
        failing = _Streams([_out(5), _out(0, "error", "grammar failed to compile")])
        with pytest.raises(PDRequestError, match="grammar failed"):
            async for _ in serve_plain_generate(failing, {}, None, "r"):
                pass
        assert failing.closed
        left = _Streams([_out(5), _out(6), _out(7, "length")])
        gen = serve_plain_generate(left, {}, None, "r")
        await gen.__anext__()
        await gen.aclose()
        assert left.closed  # closed with it, at once

    asyncio.run(run())
