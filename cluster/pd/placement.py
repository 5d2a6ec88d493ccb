"""Where a P/D prompt is prefilled (`PrefillPlacement`, conditional disaggregation after NVIDIA
Dynamo's disaggregated router): disaggregation keeps prompts off the decode engines, so their
inter-token latency stays steady. In a burst it has a price: every prompt queues on the
prefill replicas while the decode engines wait for work, so the last prompt's first token
comes after the whole burst's prefill on the prefill replicas alone. Once those are that busy,
a prompt is better prefilled where it will be decoded; the decode engine runs a request
without KV transfer params as a plain request, and its answer is the same. The rule counts
the prompts this ingress has in flight (sent, first token not back yet), per replica of each
role:
- a prompt of at most `max_local_prefill_length` tokens is prefilled on its decode engine:
  computing a short prompt costs less than exporting, fetching and loading its KV (0: none);
- any other prompt goes to a prefill replica, unless those already hold `local_prefill_queue`
  or more prompts each; then it joins the shorter queue: a decode engine when those hold
  fewer local prefills each than the prefill replicas hold prompts (0: never).
Each ingress replica counts its own prompts; with several, each sees its share of the load.
Figures: docs/benchmarks.md#http-against-offline-with-guidellm.

Decode-only fallback (`PrefillFallback`, as llm-d's sidecar and Dynamo's router fall back to
aggregated serving): when no prefill replica can take a prompt soon, its decode engine prefills
it, whatever the rule above says. Soon means: a prefill replica is on the Coordinator's board
(none: all dead, draining, or scaled to 0), the prefill replicas hold fewer than
`max_prefill_queue_size` of this ingress's prompts each, the prefill call answers within its
bound (`PrefillPlacement.timeout_s`) and its replica did not die during it. A prefill call that
failed so has sent the client nothing yet (pd_flow streams from the prefill's first token on),
so the request starts again on the decode engine, whose answer is the healthy path's; the call
is cancelled and its transfer released first (pd_flow's cleanup). `enforce_disagg` (Dynamo's
name) answers 503 with Retry-After instead.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from cluster.replica.errors import ReplicaError
from cluster.roles import Role
from engine.errors import ParameterError, check_int, check_number

logger = logging.getLogger(__name__)


# Least time between two refreshes of the replica counts (a scale takes longer than this).
COUNTS_PERIOD_S = 5.0
# A Coordinator that does not answer by then is asked again at the next refresh.
COUNTS_TIMEOUT_S = 10.0
# Decode-only fallback (docs/pd.md#decode-only-fallback). The least time a prefill call is
# given (--prefill-timeout-s): a healthy call of a short prompt takes well under a second, but
# one queued behind a burst or slowed by a loaded host takes seconds, and a prompt prefilled
# twice by a false alarm costs the machine that compute again. A long prompt, or one behind
# others, is given PREFILL_TIMEOUT_SLACK times what it should take at the pace this ingress
# measured; until a call was measured, PREFILL_TIMEOUT_COLD times the least (a cold replica's
# first calls are slower).
PREFILL_TIMEOUT_S = 10.0
PREFILL_TIMEOUT_SLACK = 4.0
PREFILL_TIMEOUT_COLD = 3.0
# Prompts of this ingress per prefill replica beyond which the next prefills on its decode
# replica (Dynamo's max_prefill_queue_size). Above what conditional disaggregation's default
# (2) lets build up before it shares the burst, so it binds only when that is off or the decode
# replicas are as busy: a prompt behind 32 others waits for 32 prefills.
MAX_PREFILL_QUEUE_SIZE = 32
# Why a prompt fell back (the `reason` of pdserve:pd_fallback_total): no prefill replica on
# the board, their queue over its bound, a prefill call over its time, its replica gone, its
# replica's engine dead (a core process or a rank gone: the replica answers until Serve
# replaces it, but it computes nothing).
FALLBACK_REASONS = ("no_replicas", "queue", "timeout", "replica_died", "engine_died")


class PrefillUnavailable(ReplicaError):
    """No prefill replica can take the prompt soon (`reason`: one of FALLBACK_REASONS). Raised
    before the client got anything: the prompt can start again on its decode engine, or (with
    enforce_disagg) the client gets a 503 with Retry-After."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class PrefillFallback:
    """When a P/D prompt is prefilled on its decode engine because no prefill replica can take
    it soon, or (enforce_disagg) refused with a 503."""

    enforce_disagg: bool = False
    prefill_timeout_s: float = PREFILL_TIMEOUT_S  # 0: a prefill call is waited for as long as it takes
    max_prefill_queue_size: int = MAX_PREFILL_QUEUE_SIZE  # 0: no bound

    def __post_init__(self) -> None:
        check_number("prefill_timeout_s", self.prefill_timeout_s)
        if not 0 <= self.prefill_timeout_s <= 3600:
            raise ParameterError("prefill_timeout_s", f"prefill_timeout_s must be in [0, 3600] seconds (0: no "
                                                      f"bound), got {self.prefill_timeout_s!r}")
        check_int("max_prefill_queue_size", self.max_prefill_queue_size, minimum=0)


class PrefillPace:
    """Seconds per computed prompt token of this ingress's prefill calls, queue and transfer
    included (so a loaded prefill pool gives longer bounds), over recent calls: each older call
    weighs DECAY times less. Tokens found in the prefill replica's prefix cache are not counted,
    or a cached prompt would make an uncached one look late."""

    DECAY = 0.8

    def __init__(self) -> None:
        self._tokens = 0.0
        self._seconds = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        self._tokens = self._tokens * self.DECAY + max(1, tokens)
        self._seconds = self._seconds * self.DECAY + max(0.0, seconds)

    def seconds(self, tokens: float) -> float | None:
        """What `tokens` should take now; None before any call was measured."""
        if self._tokens == 0.0:
            return None
        return tokens * self._seconds / self._tokens


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
        self._answered = False
        self._asked_at = -math.inf
        self._refreshing: asyncio.Task | None = None

    def __call__(self, role: str) -> int:
        return max(1, self.live(role) or 0)  # none reporting (starting, or all gone): as if one

    def live(self, role: str) -> int | None:
        """The replicas of `role` on the board (0: none reports), or None until the
        Coordinator first answered."""
        now = time.monotonic()
        if now - self._asked_at >= self.period_s and (self._refreshing is None or self._refreshing.done()):
            self._asked_at = now
            self._refreshing = asyncio.ensure_future(self._refresh())
        return self._counts[role] if self._answered else None

    async def _refresh(self) -> None:
        try:
            replicas = await asyncio.wait_for(self._coordinator.replicas.remote(), COUNTS_TIMEOUT_S)
            self._counts = Counter(r.role for r in replicas)
            self._answered = True
        except Exception as e:  # the coordinator restarting or slow: keep the last counts
            logger.warning("replica counts not refreshed (kept %s): %s", dict(self._counts), e)


class PrefillPlacement:
    """The ingress's prompts in flight on each side, the choice for the next one, and the
    decode-only fallback."""

    def __init__(self, rule: LocalPrefillRule, replicas: Callable[[str], int],
                 fallback: PrefillFallback = PrefillFallback(),
                 live: Callable[[str], int | None] = lambda role: None) -> None:
        self.rule = rule
        self.replicas = replicas  # role -> live replicas (at least 1)
        self.fallback = fallback
        self.live = live  # role -> replicas on the board (None: not known yet)
        # Prompts whose first token is not back yet: "remote" on prefill replicas, "local" on
        # decode replicas; and the remote ones' tokens.
        self.in_flight = {"remote": 0, "local": 0}
        self.remote_tokens = 0
        self.pace = PrefillPace()

    def choose_local(self, prompt_len: int) -> bool:
        return self.rule.local(prompt_len, self.in_flight["remote"] / self.replicas(Role.PREFILL),
                               self.in_flight["local"] / self.replicas(Role.DECODE))

    def unavailable(self) -> PrefillUnavailable | None:
        """Why no prefill replica can take a prompt now, or None."""
        if self.live(Role.PREFILL) == 0:
            return PrefillUnavailable("no_replicas", "no prefill replica is live (dead, draining or scaled to 0)")
        bound = self.fallback.max_prefill_queue_size
        if bound and self.in_flight["remote"] / self.replicas(Role.PREFILL) >= bound:
            return PrefillUnavailable("queue", f"the prefill replicas hold {bound} or more prompts each "
                                               "(max_prefill_queue_size)")
        return None

    def timeout_s(self, prompt_len: int) -> float | None:
        """How long the prefill call of a prompt of `prompt_len` tokens may take: the least
        bound, or PREFILL_TIMEOUT_SLACK times what it and the prompts ahead of it on a prefill
        replica should take at the measured pace. None: no bound."""
        least = self.fallback.prefill_timeout_s
        if not least:
            return None
        expected = self.pace.seconds(self.remote_tokens / self.replicas(Role.PREFILL) + prompt_len)
        if expected is None:
            return PREFILL_TIMEOUT_COLD * least
        return max(least, PREFILL_TIMEOUT_SLACK * expected)

    def route(self, prompt_len: int) -> Route:
        """Where a prompt of `prompt_len` tokens prefills, decided as its request starts (a
        request never started is never counted); it counts in flight on that side until its
        first output or its end (`Route`). With no prefill replica able to take it soon it
        prefills on its decode engine, or (enforce_disagg) PrefillUnavailable is raised."""
        why = self.unavailable()
        if why is None:
            return Route(self, prompt_len, remote=not self.choose_local(prompt_len))
        self._give_up(why, prompt_len)
        return Route(self, prompt_len, remote=False, fallback=why.reason)

    def _give_up(self, why: PrefillUnavailable, prompt_len: int) -> None:
        if self.fallback.enforce_disagg:
            raise why
        logger.info("prompt of %d tokens prefilled on its decode replica: %s", prompt_len, why)

    def _count(self, side: str, prompt_len: int, sign: int) -> None:
        self.in_flight[side] += sign
        self.remote_tokens += sign * prompt_len if side == "remote" else 0


class Route:
    """Where one prompt is prefilled: `remote` (a prefill replica, its call bounded by
    `timeout_s`) or on its decode engine, with the fallback `reason` that sent it there (None:
    the rule did, or it is remote). Counted in flight on its side from its start until its
    first output or its end, whichever comes first."""

    def __init__(self, placement: PrefillPlacement, prompt_len: int, remote: bool, fallback: str | None = None):
        self.placement, self.prompt_len = placement, prompt_len
        self.remote, self.fallback = remote, fallback
        self.timeout_s = placement.timeout_s(prompt_len) if remote else None
        self._start = time.monotonic()
        self._counted = True
        placement._count(self.side, prompt_len, 1)

    @property
    def side(self) -> str:
        return "remote" if self.remote else "local"

    def first_output(self, out) -> None:
        """The request's output came back (its first token): no longer in flight. A remote
        prefill's time feeds the pace, less the tokens its replica had cached."""
        if not self._counted:
            return
        self.end()
        if self.remote:
            self.placement.pace.observe(self.prompt_len - getattr(out, "num_cached_tokens", 0),
                                        time.monotonic() - self._start)

    def fall_back(self, why: PrefillUnavailable) -> None:
        """The prefill replica could not take the prompt after all (PrefillUnavailable, raised
        before the client got anything): it starts again on its decode engine, or
        (enforce_disagg) `why` is raised."""
        self.end()
        self.placement._give_up(why, self.prompt_len)
        self.remote, self.fallback, self.timeout_s = False, why.reason, None
        self._start, self._counted = time.monotonic(), True
        self.placement._count("local", self.prompt_len, 1)

    def end(self) -> None:
        """The request ended (or its first output came): uncounted, once."""
        if self._counted:
            self._counted = False
            self.placement._count(self.side, self.prompt_len, -1)
