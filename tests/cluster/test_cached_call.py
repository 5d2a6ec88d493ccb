"""CachedCall (cluster/http/cached_call.py): what keeps a flood of /health and /metrics from
becoming a flood of Coordinator calls."""

from __future__ import annotations

import asyncio

import pytest

from cluster.http.cached_call import CachedCall


class _Coordinator:
    """Answers when released, counting calls; `fail` makes the next answer an error."""

    def __init__(self) -> None:
        self.calls, self.fail = 0, False
        self.release = asyncio.Event()

    async def replicas(self) -> int:
        self.calls += 1
        await self.release.wait()
        if self.fail:
            raise RuntimeError("coordinator restarting")
        return self.calls


def test_a_flood_of_askers_makes_one_call_and_they_all_get_its_answer():
    async def run():
        coordinator = _Coordinator()
        cached = CachedCall(coordinator.replicas, max_age_s=0.0)
        askers = [asyncio.ensure_future(cached.get()) for _ in range(500)]
        await asyncio.sleep(0)  # let every asker reach the call in flight
        coordinator.release.set()
        assert await asyncio.gather(*askers) == [1] * 500
        assert coordinator.calls == 1
        assert await cached.get() == 2  # max_age 0: the next asker after it makes a new call
    asyncio.run(run())


def test_an_answer_is_reused_within_its_age_and_a_failure_is_not_kept():
    async def run():
        coordinator = _Coordinator()
        coordinator.release.set()
        cached = CachedCall(coordinator.replicas, max_age_s=3600.0)
        assert [await cached.get() for _ in range(50)] == [1] * 50
        fresh = CachedCall(coordinator.replicas, max_age_s=3600.0)
        coordinator.fail = True
        with pytest.raises(RuntimeError, match="restarting"):
            await fresh.get()
        coordinator.fail = False
        assert await fresh.get() == 3  # the failure was not cached: asked again
    asyncio.run(run())


def test_an_asker_that_leaves_does_not_cancel_the_call_for_the_others():
    async def run():
        coordinator = _Coordinator()
        cached = CachedCall(coordinator.replicas, max_age_s=0.0)
        leaving, staying = asyncio.ensure_future(cached.get()), asyncio.ensure_future(cached.get())
        await asyncio.sleep(0)
        leaving.cancel()  # its client went away
        coordinator.release.set()
        assert await staying == 1 and coordinator.calls == 1
    asyncio.run(run())
