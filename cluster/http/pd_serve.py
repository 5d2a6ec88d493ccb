"""How the ingress runs one request on engine replicas: whole on one engine (colocated, or a
P/D prompt prefilled where it decodes), or split over a Prefill replica and a decode engine.

The split is `kvstore.pd.pd_flow`; what differs from plain actors is how a request
travels: the prefill is one routed call (cancelled if the request is left early, which Serve
delivers to the replica running it), and the decode (or colocated) half runs on an
`EngineStreams`: the ingress's own engine with direct streaming (cluster.replica.server, called
in process; the prompt KV then comes back in the prefill's reply into that engine's inbox,
kvstore.handoff, instead of through the store), or the per-step messages of routed engine
replicas (cluster.replica.front_streams, whose abort is routed to the replica holding the
request, freeing its KV blocks).

Where a P/D prompt is prefilled (`PrefillPlacement`, conditional disaggregation after NVIDIA
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
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

import grpc
import ray

from actors.roles import Role
from cluster.replica.front_streams import REPLICA_ERRORS
from engine.errors import ParameterError, check_int, check_number
from engine.kv_transfer_params import KVTransferParams
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from kvstore.handoff import GRPC_MAX_MESSAGE, Inbox, max_reply_kv_bytes
from kvstore.pd import PDRequestError, pd_flow

logger = logging.getLogger(__name__)


class EngineStreams(Protocol):
    """Where a request runs whole, or its decode half: one request's cumulative outputs, the
    request aborted on its engine when the iterator is closed early. An engine that fails
    raises PDRequestError(replica_died=True)."""

    def generate(self, prompt: dict, params: SamplingParams, request_id: str,
                 kv_transfer_params: KVTransferParams | None = None) -> AsyncIterator[RequestOutput]: ...


class ServePeers:
    def __init__(self, prefill_handle, decode_streams: EngineStreams, store, inbox: Inbox | None = None,
                 prefill_timeout_s: float | None = None) -> None:
        self.prefill_handle = prefill_handle
        self.prefill_timeout_s = prefill_timeout_s  # None: the prefill call is waited for as long as it takes
        self.decode_streams = decode_streams
        self.store = store
        # The local decode engine's inbox (direct streaming), where a handed-back KV waits.
        self.inbox = inbox
        self._handed_off = False
        self._open: list = []  # prefill responses that may still be running on a replica
        self._decoding: AsyncIterator | None = None

    async def prefill(self, prompt, params: SamplingParams, request_id: str, transfer_id: str) -> RequestOutput:
        if self.inbox is None:
            response = self.prefill_handle.prefill.remote(prompt, params, request_id, transfer_id)
        else:
            # The bound is this process's: its gRPC client is what refuses a reply too big.
            response = self.prefill_handle.prefill_handoff.remote(prompt, params, request_id, transfer_id,
                                                                  max_reply_kv_bytes())
        self._open.append(response)
        try:
            out = await (response if self.prefill_timeout_s is None
                         else asyncio.wait_for(response, self.prefill_timeout_s))
        except TimeoutError as e:
            # Still open: the cleanup cancels it on its replica (when that one runs again).
            raise PrefillUnavailable("timeout", f"the prefill call did not answer within "
                                                f"{self.prefill_timeout_s:.1f} s") from e
        except ray.exceptions.RayActorError as e:  # died or unreachable (ActorUnavailableError)
            raise PrefillUnavailable("replica_died", f"prefill replica unavailable: {e}") from e
        except REPLICA_ERRORS as e:
            raise PDRequestError(f"prefill replica unavailable: {e}") from e
        except grpc.aio.AioRpcError as e:
            # Serve turns only UNAVAILABLE into ActorUnavailableError. A reply over a channel's
            # limit (RESOURCE_EXHAUSTED: the KV is bounded, so the output itself, e.g. a long
            # prompt's prompt_logprobs) would fail again on a retry: a 500 naming the setting.
            # Any other status fails this request with a retryable 503.
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise RuntimeError(f"the prefill's reply is over the gRPC message limit ({e.details()}); "
                                   f"raise {GRPC_MAX_MESSAGE}") from e
            raise PDRequestError(f"prefill call failed: {e.code().name}: {e.details()}") from e
        except Exception as e:
            # The prefill replica's own failure (its engine died), which Serve's gRPC path
            # re-raises as itself, not as a RayTaskError: the request failed on a replica.
            raise PDRequestError(f"prefill failed on its replica: {type(e).__name__}: {e}") from e
        self._open.remove(response)
        if self.inbox is None:
            return out
        if out.handed_off:
            # Before the decode request exists, so its fetch finds it.
            self.inbox.deliver(transfer_id, out.value)
            self._handed_off = True
        return out.output

    async def decode(self, prompt, params: SamplingParams, request_id: str,
                     kv_params: KVTransferParams) -> AsyncIterator[RequestOutput]:
        # Over the decode replica's per-step messages; a broken subscription raises
        # PDRequestError(replica_died=True), as a dead replica's stream did before.
        self._decoding = self.decode_streams.generate(prompt, params, request_id, kv_params)
        async for out in self._decoding:
            yield out

    async def cleanup(self, request_id: str, transfer_id: str | None, unfinished: bool) -> None:
        if unfinished:
            for response in self._open:
                response.cancel()
        self._open.clear()
        if self._decoding is not None:
            await self._decoding.aclose()  # aborts the request on its decode replica if unfinished
        if transfer_id is None:
            return
        if self._handed_off:
            self.inbox.forget(transfer_id)  # never in the store
        else:
            await asyncio.gather(self.store.release.remote(transfer_id), return_exceptions=True)


def serve_pd_generate(prefill_handle, decode_streams: EngineStreams, store, prompt, params: SamplingParams,
                      request_id: str, load_failure_policy: str = "fail", inbox: Inbox | None = None,
                      prefill_timeout_s: float | None = None) -> AsyncIterator[RequestOutput]:
    return pd_flow(ServePeers(prefill_handle, decode_streams, store, inbox, prefill_timeout_s), prompt, params,
                   request_id, load_failure_policy)


async def serve_plain_generate(streams: EngineStreams, prompt, params: SamplingParams, request_id: str
                               ) -> AsyncIterator[RequestOutput]:
    """A request run whole on one engine replica: every request in colocated mode, and a P/D
    request prefilled on its decode replica (cluster.http.pd_serve). An engine-side failure
    (finish_reason "error": a KV load, or a data-parallel core that could not take the request)
    is an error, as pd_flow makes it on the disaggregated path, so the client gets a 503 in
    OpenAI's error shape, never a 200 carrying a partial answer, whatever the mode and wherever
    the prompt ran."""
    async with aclosing(streams.generate(prompt, params, request_id)) as outputs:
        async for out in outputs:
            c = out.outputs[0]
            if out.finished and c.finish_reason == "error":
                raise PDRequestError(f"the engine failed the request: {c.stop_reason}")
            yield out


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
# the board, their queue over its bound, a prefill call over its time, its replica gone.
FALLBACK_REASONS = ("no_replicas", "queue", "timeout", "replica_died")


class PrefillUnavailable(PDRequestError):
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

    async def run(self, prompt_len: int, remote: Callable[[float | None], AsyncIterator],
                  local: Callable[[], AsyncIterator], on_local: Callable[[], None] = lambda: None,
                  on_fallback: Callable[[str], None] = lambda reason: None) -> AsyncIterator:
        """One request's outputs: decided when it starts (a request never started is never
        counted), and counted in flight on its side until its first output or its end.
        `remote(timeout_s)` runs it disaggregated with that bound on its prefill call."""
        why = self.unavailable()
        if why is None and not self.choose_local(prompt_len):
            sent = False
            try:
                async with aclosing(self._counted("remote", prompt_len, remote(self.timeout_s(prompt_len)))) as outs:
                    async for out in outs:
                        sent = True
                        yield out
                return
            except PrefillUnavailable as e:
                if sent:  # never so (pd_flow raises it from the prefill only): not a second start
                    raise
                why = e
        elif why is None:
            on_local()
        if why is not None:
            if self.fallback.enforce_disagg:
                raise why
            logger.info("prompt of %d tokens prefilled on its decode replica: %s", prompt_len, why)
            on_fallback(why.reason)
        async with aclosing(self._counted("local", prompt_len, local())) as outs:
            async for out in outs:
                yield out

    async def _counted(self, side: str, prompt_len: int, outputs: AsyncIterator) -> AsyncIterator:
        self.in_flight[side] += 1
        remote = side == "remote"
        self.remote_tokens += prompt_len if remote else 0
        start = time.monotonic()
        counted = True
        try:
            async for out in outputs:
                if counted:
                    counted = False
                    self._uncount(side, prompt_len)
                    if remote:
                        self.pace.observe(prompt_len - getattr(out, "num_cached_tokens", 0), time.monotonic() - start)
                yield out
        finally:
            if counted:
                self._uncount(side, prompt_len)
            # Closed now, not when collected: a request left early is aborted on its replicas
            # before this returns.
            await outputs.aclose()

    def _uncount(self, side: str, prompt_len: int) -> None:
        self.in_flight[side] -= 1
        self.remote_tokens -= prompt_len if side == "remote" else 0
