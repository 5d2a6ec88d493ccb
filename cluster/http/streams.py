"""Async plumbing of the ingress: interleaving the streams of a multi-prompt request, and
timing one request's stream into the app's latency metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from cluster.http.metrics import AppMetrics
from engine.outputs import RequestOutput


async def merge(gens: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Interleave several async iterators as (index, item); closing the merge cancels them all."""
    if len(gens) == 1:
        try:
            async for item in gens[0]:
                yield 0, item
        finally:
            await gens[0].aclose()  # closing the merge closes the request now, not at GC
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, gen):
        try:
            async for item in gen:
                await queue.put((i, item))
        except Exception as e:  # handed to the consumer, which re-raises
            await queue.put((i, e))
        await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def timed(outputs: AsyncIterator[RequestOutput], metrics: AppMetrics,
                prompt_tokens: int) -> AsyncIterator[RequestOutput]:
    """`outputs` passed through, with the latency figures the client sees (TTFT, ITL, E2E,
    queue time) and the request's outcome recorded in `metrics`."""
    start = time.monotonic()
    last_token_at: float | None = None
    status, last = "error", None
    try:
        # aclosing: a request left early is closed (aborted on its replicas) now, not when collected.
        async with aclosing(outputs):
            async for out in outputs:
                if out.delta_token_ids:
                    now = time.monotonic()
                    if last_token_at is None:
                        metrics.ttft.observe(now - start)
                        if "queue_time_s" in out.metrics:
                            metrics.queue.observe(out.metrics["queue_time_s"])
                    else:
                        metrics.itl.observe(now - last_token_at)
                    last_token_at = now
                last = out
                yield out
        status = "ok"
    except (asyncio.CancelledError, GeneratorExit):
        status = "cancelled"
        raise
    finally:
        metrics.e2e.observe(time.monotonic() - start)
        completion = last.outputs[0] if last is not None else None
        metrics.request_done(status, prompt_tokens, len(completion.token_ids) if completion else 0,
                             finished_reason=completion.finish_reason if completion else None)
