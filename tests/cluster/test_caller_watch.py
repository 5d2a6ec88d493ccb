"""A stream whose caller died ends at once (cluster.replica.caller_watch,
docs/pd.md#a-caller-that-dies): the replica side of a streaming call made as a Ray actor call,
which Serve does not cancel when its caller dies. A real Ray actor is the caller and is killed;
the stream it was fed (an engine request's, in the replicas) is closed within the probe's
period, never left running to its end."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.replica.caller_watch import CallerGone, watch_handle, while_caller_lives

PERIOD_S = 0.1


class _Endless:
    """An engine's stream that never ends by itself; notes whether it was closed."""

    def __init__(self) -> None:
        self.closed = False
        self.given = 0

    async def items(self):
        try:
            while True:
                await asyncio.sleep(0.005)
                self.given += 1
                yield self.given
        finally:
            self.closed = True


def test_a_stream_ends_once_its_caller_actor_died_and_not_while_it_lives(ray_local):
    import ray

    @ray.remote(num_cpus=0)
    class Caller:
        def ping(self) -> int:
            return 1

    caller = Caller.remote()
    ray.get(caller.ping.remote())

    async def main():
        source = _Endless()
        stream = while_caller_lives(source.items(), caller, PERIOD_S)
        started = time.monotonic()
        async for _ in stream:  # several probes pass while it lives
            if time.monotonic() - started > 5 * PERIOD_S:
                break
        assert not source.closed
        ray.kill(caller)
        killed = time.monotonic()
        with pytest.raises(CallerGone):
            async for _ in stream:
                pass
        return source, time.monotonic() - killed

    source, took = asyncio.run(asyncio.wait_for(main(), 60))
    assert source.closed  # its finally ran: a replica's aborts its engine requests there
    assert took < 5.0, took  # the period plus Ray's death notice


def test_without_a_caller_to_watch_the_stream_passes_through():
    async def main():
        source = _Endless()
        got = []
        async for item in while_caller_lives(source.items(), None):
            got.append(item)
            if len(got) == 3:
                break
        return got

    assert asyncio.run(main()) == [1, 2, 3]


def test_only_calls_that_travel_as_actor_calls_send_a_handle():
    from types import SimpleNamespace

    grpc = SimpleNamespace(handle_options=SimpleNamespace(_by_reference=False))
    assert watch_handle(grpc) is None and watch_handle(object()) is None
    # Actor calls from a process that is no actor (a driver): nothing to watch either.
    assert watch_handle(SimpleNamespace(handle_options=SimpleNamespace(_by_reference=True))) is None
