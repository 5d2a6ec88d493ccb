"""Where a P/D prompt is prefilled: on a prefill replica, or on the decode replica that will
generate its tokens (conditional disaggregation, after NVIDIA Dynamo's disaggregated router).

Disaggregation keeps prompts off the decode replicas, so their inter-token latency stays
steady. In a burst it has a price: every prompt queues on the prefill replicas while the
decode replicas wait for work, so the last prompt's first token comes after the whole burst's
prefill on the prefill replicas alone (on 2 CPU cores at concurrency 8: TTFT p95 13.5-17.9 s
in P/D, 7.7-10.8 s colocated). Once the prefill replicas are that busy, a prompt is better prefilled
where it will be decoded; the decode replica runs a request without KV transfer params as a
plain request, and its answer is the same.

The rule counts the prompts this ingress has in flight (sent, first token not back yet), per
replica of each role:
- a prompt of at most `max_local_prefill_length` tokens is prefilled on its decode replica:
  computing a short prompt costs less than exporting, fetching and loading its KV (0: none);
- any other prompt goes to a prefill replica, unless those already hold `local_prefill_queue`
  or more prompts each; then it joins the shorter queue: a decode replica when those hold
  fewer local prefills each than the prefill replicas hold prompts (0: never).
Each ingress replica counts its own prompts; with several, each sees its share of the load.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Least time between two refreshes of the replica counts (a scale takes longer than this).
COUNTS_PERIOD_S = 5.0
# A Coordinator that does not answer by then is asked again at the next refresh.
COUNTS_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class LocalPrefillRule:
    local_prefill_queue: int = 0  # prompts in flight per prefill replica before any goes local; 0: never
    max_local_prefill_length: int = 0  # prompts this short always prefill locally; 0: none

    def local(self, prompt_len: int, remote_each: float, local_each: float) -> bool:
        """Whether a prompt of `prompt_len` tokens is prefilled on its decode replica, given the
        prompts in flight per prefill replica and the local prefills per decode replica."""
        if prompt_len <= self.max_local_prefill_length:
            return True
        if self.local_prefill_queue == 0 or remote_each < self.local_prefill_queue:
            return False
        return local_each < remote_each


class RoleCounts:
    """Live engine replicas per role, from the Coordinator's board. A decision never waits for
    it: it reads the last counts and, when they are older than `period_s`, starts a refresh in
    the background (until the first one answers, every role counts 1)."""

    def __init__(self, coordinator, period_s: float = COUNTS_PERIOD_S) -> None:
        self._coordinator = coordinator
        self.period_s = period_s
        self._counts: Counter = Counter()
        self._asked_at = -math.inf
        self._refreshing: asyncio.Task | None = None

    def __call__(self, role: str) -> int:
        now = time.monotonic()
        if now - self._asked_at >= self.period_s and (self._refreshing is None or self._refreshing.done()):
            self._asked_at = now
            self._refreshing = asyncio.ensure_future(self._refresh())
        return max(1, self._counts[role])  # none reporting (starting, or all gone): as if one

    async def _refresh(self) -> None:
        try:
            replicas = await asyncio.wait_for(self._coordinator.replicas.remote(), COUNTS_TIMEOUT_S)
            self._counts = Counter(r["role"] for r in replicas)
        except Exception as e:  # the coordinator restarting or slow: keep the last counts
            logger.warning("replica counts not refreshed (kept %s): %s", dict(self._counts), e)


class PrefillPlacement:
    """The ingress's prompts in flight on each side, and the choice for the next one."""

    def __init__(self, rule: LocalPrefillRule, replicas: Callable[[str], int]) -> None:
        self.rule = rule
        self.replicas = replicas  # role -> live replicas
        # Prompts whose first token is not back yet: "remote" on prefill replicas, "local" on
        # decode replicas.
        self.in_flight = {"remote": 0, "local": 0}

    def choose_local(self, prompt_len: int) -> bool:
        return self.rule.local(prompt_len, self.in_flight["remote"] / self.replicas("prefill"),
                               self.in_flight["local"] / self.replicas("decode"))

    async def run(self, prompt_len: int, remote: Callable[[], AsyncIterator],
                  local: Callable[[], AsyncIterator], on_local: Callable[[], None] = lambda: None) -> AsyncIterator:
        """One request's outputs: decided when it starts (a request never started is never
        counted), and counted in flight on its side until its first output or its end."""
        is_local = self.choose_local(prompt_len)
        outputs = local() if is_local else remote()
        if is_local:
            on_local()
        side = "local" if is_local else "remote"
        self.in_flight[side] += 1
        counted = True
        try:
            async for out in outputs:
                if counted:
                    counted = False
                    self.in_flight[side] -= 1
                yield out
        finally:
            if counted:
                self.in_flight[side] -= 1
            # Closed now, not when collected: a request left early is aborted on its replicas
            # before this returns.
            await outputs.aclose()
