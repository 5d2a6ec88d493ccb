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

from actors.roles import Role
from cluster.replica.front_streams import REPLICA_ERRORS
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
    def __init__(self, prefill_handle, decode_streams: EngineStreams, store, inbox: Inbox | None = None) -> None:
        self.prefill_handle = prefill_handle
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
            out = await response
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
                      request_id: str, load_failure_policy: str = "fail",
                      inbox: Inbox | None = None) -> AsyncIterator[RequestOutput]:
    return pd_flow(ServePeers(prefill_handle, decode_streams, store, inbox), prompt, params, request_id,
                   load_failure_policy)


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
            self._counts = Counter(r.role for r in replicas)
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
        return self.rule.local(prompt_len, self.in_flight["remote"] / self.replicas(Role.PREFILL),
                               self.in_flight["local"] / self.replicas(Role.DECODE))

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
