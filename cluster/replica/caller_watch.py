"""A stream whose caller died ends at once (docs/pd.md#a-caller-that-dies).

A Serve streaming call made over gRPC (Serve's throughput mode, pdserve's default) is
cancelled on the replica running it as soon as its caller's process dies (0.12 s measured), and
the replica's generator closes, which aborts the engine requests behind it. Made as a Ray actor
call (RAY_SERVE_THROUGHPUT_OPTIMIZED=0) it is not: a dead ingress's request decoded to its
`max_tokens` for nobody (18.7 s measured). Such a caller sends its own actor handle with the
call, and the replica asks it every `period_s` whether it lives (`__ray_ready__`, answered by
Ray itself, never queued behind the caller's work): 1.3 s measured.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import ray

WATCH_PERIOD_S = 1.0


class CallerGone(RuntimeError):
    """The caller of a stream died: nobody reads what it would send."""


def watch_handle(handle):
    """What a caller sends with its streaming calls through `handle` (a DeploymentHandle): its
    own actor handle when they travel as Ray actor calls, else None (gRPC cancels them)."""
    options = getattr(handle, "handle_options", None)
    if not getattr(options, "_by_reference", False) or not ray.is_initialized():
        return None
    try:
        return ray.get_runtime_context().current_actor
    except RuntimeError:  # not an actor (a driver): nothing to watch
        return None


async def _dies(caller, period_s: float) -> None:
    """Returns once `caller` is dead (a slow answer is a busy caller, not a dead one)."""
    while True:
        await asyncio.sleep(period_s)  # a probe's period, not a synchronisation
        try:
            await caller.__ray_ready__.remote()
        except ray.exceptions.RayActorError:  # ActorDiedError, ActorUnavailableError
            return


async def while_caller_lives(items: AsyncIterator, caller, period_s: float = WATCH_PERIOD_S) -> AsyncIterator:
    """`items` as they come while `caller` (an actor handle; None: nothing to watch) lives; once
    it is found dead, `items` is closed (its finally aborts what it served) and CallerGone is
    raised."""
    if caller is None:
        async for item in items:
            yield item
        return
    watcher = asyncio.ensure_future(_dies(caller, period_s))
    it = items.__aiter__()
    try:
        while True:
            step = asyncio.ensure_future(it.__anext__())
            await asyncio.wait({step, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
                raise CallerGone("the caller of this stream died")
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await items.aclose()
