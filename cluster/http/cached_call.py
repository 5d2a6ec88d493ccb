"""The latest answer of a call to the Coordinator, shared by every request that asks within a
short age: /health and /metrics are open to anyone (load balancers, Prometheus), so a flood of
them must not become a flood of Coordinator calls, which would slow the Coordinator for every
replica and make /health answer 503 while it queues them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class CachedCall(Generic[T]):
    def __init__(self, call: Callable[[], Awaitable[T]], max_age_s: float) -> None:
        self.call, self.max_age_s = call, max_age_s
        self._value: T | None = None
        self._at = float("-inf")
        self._inflight: asyncio.Future | None = None
        self.calls = 0  # calls made (tests count them)

    async def get(self) -> T:
        """The answer at most `max_age_s` old. Callers that come while a call is running share
        it (one call however many ask); its failure is theirs, and the next caller tries again."""
        if time.monotonic() - self._at <= self.max_age_s:
            return self._value
        if self._inflight is None:
            self._inflight = asyncio.ensure_future(self._refresh())
        # Shielded: a caller that goes away (its client left) must not cancel the others' call.
        return await asyncio.shield(self._inflight)

    async def _refresh(self) -> T:
        try:
            self.calls += 1
            value = await self.call()
            self._value, self._at = value, time.monotonic()
            return value
        finally:
            self._inflight = None
