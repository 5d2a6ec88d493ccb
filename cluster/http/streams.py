"""Async plumbing of the ingress: interleaving the streams of a multi-prompt request, and
timing one request's stream into the app's latency metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from cluster.http.metrics import AppMetrics
from engine.outputs import RequestOutput


def merged(streams: list[AsyncIterator[tuple[int, object]]]) -> AsyncIterator[tuple[int, object]]:
    """The (index, item) pairs of several streams as one; one stream is its own merge (no frame
    between it and its reader). Closing the result closes every stream."""
    return streams[0] if len(streams) == 1 else _interleave(streams)


async def _interleave(streams: list[AsyncIterator]) -> AsyncIterator:
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async for item in stream:
                await queue.put(item)
        except Exception as e:  # handed to the consumer, which re-raises
            await queue.put(e)
        await queue.put(done)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class RequestClock:
    """The latency figures the client sees of one request (TTFT, ITL, E2E, queue time) and its
    outcome, recorded in `metrics` as its outputs pass (`output`) and when it ends (`end`)."""

    def __init__(self, metrics: AppMetrics, prompt_tokens: int) -> None:
        self.metrics, self.prompt_tokens = metrics, prompt_tokens
        self.start = time.monotonic()
        self.last_token_at: float | None = None
        self.last: RequestOutput | None = None

    def output(self, out: RequestOutput) -> None:
        if out.delta_token_ids:
            now = time.monotonic()
            if self.last_token_at is None:
                self.metrics.ttft.observe(now - self.start)
                if "queue_time_s" in out.metrics:
                    self.metrics.queue.observe(out.metrics["queue_time_s"])
            else:
                self.metrics.itl.observe(now - self.last_token_at)
            self.last_token_at = now
        self.last = out

    def end(self, status: str) -> None:
        """`status`: "ok", "error" or "cancelled"."""
        self.metrics.e2e.observe(time.monotonic() - self.start)
        completion = self.last.outputs[0] if self.last is not None else None
        self.metrics.request_done(status, self.prompt_tokens, len(completion.token_ids) if completion else 0,
                                  finished_reason=completion.finish_reason if completion else None)
