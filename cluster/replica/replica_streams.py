"""Ingress side of the per-step messages: submit requests to an engine deployment, keep one
subscription per engine replica that holds some of them, and demultiplex its messages
(lists of RequestDeltas, cluster.replica.step_channel) into per-request streams of RequestOutputs.

Request state (the cumulative text, token ids and logprobs) lives here, in
`DeltaAccumulator`s, so the engine replicas send deltas only. Detokenization stays on the
engine replica: stop strings are checked there, in the step that produced them, so a stopped
request frees its KV blocks at once and no token past the stop is computed or sent.

Failure: if a subscription breaks (the replica died, or its engine did), every request of
this ingress on that replica fails with ReplicaError(replica_died=True) — the P/D flow then
releases the transfer itself, as before. A request left early (client gone, error) is aborted
on its replica by a call routed to that replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import ray

from cluster.replica.caller_watch import watch_handle
from cluster.replica.errors import ReplicaError
from cluster.tasks import detached_task
from engine.engine_request import EngineRequest
from engine.outputs import DeltaAccumulator, RequestDelta, RequestOutput

logger = logging.getLogger(__name__)
# How long a request left during its submit call waits for that call, to abort what it queued.
_SUBMIT_WAIT_S = 30.0
# Resubmissions of a request whose replica left the routing table before any output came back.
_MAX_RESUBMITS = 2
# How long submits pass over a replica whose subscription failed (its engine died or hung):
# Serve replaces it after three failed health checks (5 s apart by default).
AVOID_FAILED_S = 30.0


class ReplicaUnrouted(ReplicaError):
    """The replica holding a request can no longer be reached by a call naming it: Serve took
    it out of routing (scale-down, replacement) between the request's submit and the
    ingress's subscription. With no output delivered yet, the request can run elsewhere."""

    def __init__(self, message: str) -> None:
        super().__init__(message, replica_died=True)

# Errors meaning the replica (not the request) failed: gone, unreachable, or its engine died
# (the ingress validated the request, so an error raised inside a replica is the replica's).
REPLICA_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                  ray.exceptions.RayTaskError)


class ReplicaStreams:
    def __init__(self, handle, ingress_id: str) -> None:
        self.handle = handle
        self.stream_handle = handle.options(stream=True)
        self.ingress_id = ingress_id
        # Sent with each subscription when our calls are Ray actor calls, so an engine replica
        # ends our requests if we die (cluster.replica.caller_watch).
        caller = watch_handle(handle)
        self._watch = {} if caller is None else {"caller": caller}
        self._queues: dict[str, asyncio.Queue] = {}  # request id -> its deltas (or an error)
        self._where: dict[str, str] = {}  # request id -> replica holding it
        self._subs: dict[str, asyncio.Task] = {}  # replica -> its subscription's pump
        self._closing = False  # close() called: a cancelled pump ends instead of listening again
        self._failed: dict[str, float] = {}  # replica -> until when submits avoid it (its engine failed)
        self.messages = 0  # received, for tests and benchmarks
        self.deltas = 0

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """One request's cumulative outputs; leaving early aborts it on its replica."""
        request_id = request.request_id
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        acc = DeltaAccumulator(request_id, request.prompt, request.prompt_token_ids,
                               request.sampling_params.logprobs is not None)
        finished = False
        resubmits = 0
        submitted: asyncio.Future | None = None

        async def submit() -> None:
            nonlocal submitted, finished
            submitted = asyncio.ensure_future(self._submit(request))
            try:
                # Shielded: if this request is left while the call is on its way, the call still
                # completes, and the finally below learns where to abort it.
                replica = await asyncio.shield(submitted)
            except REPLICA_ERRORS as e:
                finished = True  # nothing was queued anywhere
                raise ReplicaError(f"replica unavailable: {e}", replica_died=True) from e
            self._where[request_id] = replica
            self._ensure_subscribed(replica)

        try:
            await submit()
            while not finished:
                item = await q.get()
                if (isinstance(item, ReplicaUnrouted) and not acc.token_ids
                        and resubmits < _MAX_RESUBMITS):
                    # Nothing came back yet, and its replica is leaving (Serve stops it with its
                    # engine): run the request on a replica that stays. Bounded.
                    resubmits += 1
                    logger.info("resubmitting %s: %s", request_id, item)
                    # Without the prompt's KV: the leaving replica may have loaded it, or
                    # dropped the load when it stopped; either releases the transfer, and a
                    # second load would fail the request (seen under scale-down, CI). The new
                    # replica computes the prompt itself; the P/D flow releases the transfer.
                    if request.kv_transfer_params is not None:
                        request = dataclasses.replace(
                            request, kv_transfer_params=request.kv_transfer_params.computed_locally())
                    await submit()
                    continue
                if isinstance(item, BaseException):
                    finished = True  # its replica is gone with it
                    raise item
                # Deltas that queued up while the consumer was busy go out as one output.
                while not q.empty() and not item.finished:
                    more = q.get_nowait()
                    if isinstance(more, BaseException):
                        finished = True
                        raise more
                    item.merge(more)
                finished = item.finished
                yield acc.add(item)
        finally:
            self._queues.pop(request_id, None)
            replica = self._where.pop(request_id, None)
            if not finished and replica is None and submitted is not None:
                try:  # left during the submit call: where did it go?
                    replica = await asyncio.wait_for(asyncio.shield(submitted), _SUBMIT_WAIT_S)
                except BaseException:
                    replica = None  # refused or unreachable: nothing queued, or its replica is gone
            if not finished and replica is not None:
                try:
                    await asyncio.shield(self.handle.abort.remote(request_id, replica=replica))
                except Exception as e:  # a gone replica holds nothing any more
                    logger.debug("abort of %s on %s: %s", request_id, replica, e)

    async def abort(self, request_id: str) -> None:
        """End a request from outside its stream, on the replica holding it (none: nothing to do)."""
        replica = self._where.get(request_id)
        if replica is not None:
            await self.handle.abort.remote(request_id, replica=replica)

    async def check_health(self) -> None:
        """Nothing of this client's own can fail: the replicas it routes to are Serve's to
        health-check (an unhealthy one is replaced, and routed around until then)."""

    async def _submit(self, request: EngineRequest) -> str:
        now = time.monotonic()
        self._failed = {r: until for r, until in self._failed.items() if until > now}
        # The router passes over replicas that failed lately (a migrated request goes elsewhere).
        avoid = {"avoid": sorted(self._failed)} if self._failed else {}
        return await self.handle.submit.remote(request, self.ingress_id, **avoid)

    def _ensure_subscribed(self, replica: str, idle_closes: int = 0) -> None:
        if replica not in self._subs:
            # Detached from the HTTP request that needed it: otherwise a client leaving would
            # cancel the subscription, and every other request on that replica would lose its
            # messages.
            self._subs[replica] = detached_task(self._pump(replica, idle_closes))

    async def _pump(self, replica: str, idle_closes: int) -> None:
        error: BaseException | None = None
        got = 0
        try:
            stream = self.stream_handle.subscribe.remote(self.ingress_id, replica=replica, **self._watch)
            async for batch in stream:
                got += 1
                self.messages += 1
                self.deltas += len(batch)
                self._dispatch(batch)
        except asyncio.CancelledError:
            if self._closing:
                raise  # close(): this ingress is going away
            # The call was cancelled, not this task: handled as a close (listen again, bounded).
        except Exception as e:
            error = e
        finally:
            self._subs.pop(replica, None)
        mine = [rid for rid, r in self._where.items() if r == replica]
        if error is None and mine and got == 0 and idle_closes >= 1:
            # Closed idle twice in a row while we wait on it: it holds none of them any more.
            error = RuntimeError("the replica no longer holds these requests")
        if error is not None:
            logger.warning("subscription to replica %s failed: %s", replica, error)
            # ReplicaGone: the call naming this replica reached another one (cluster.replica.server).
            unrouted = "ReplicaGone" in f"{type(error).__name__}: {error}"
            if not unrouted:
                self._failed[replica] = time.monotonic() + AVOID_FAILED_S
            for rid in mine:
                self._where.pop(rid, None)
                q = self._queues.get(rid)
                if q is not None:
                    q.put_nowait(ReplicaUnrouted(f"replica unavailable: {error}") if unrouted
                                 else ReplicaError(f"replica unavailable: {error}", replica_died=True))
        elif mine:
            # It closed while idle just as new requests reached it: listen again.
            self._ensure_subscribed(replica, idle_closes + 1 if got == 0 else 0)

    def _dispatch(self, batch: list[RequestDelta]) -> None:
        for delta in batch:
            q = self._queues.get(delta.request_id)
            if q is not None:
                q.put_nowait(delta)

    async def close(self) -> None:
        self._closing = True
        for task in list(self._subs.values()):
            task.cancel()
        await asyncio.gather(*self._subs.values(), return_exceptions=True)
