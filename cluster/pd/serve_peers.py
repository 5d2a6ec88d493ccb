"""The P/D flow's peers behind Serve (cluster.pd.flow.pd_flow): a Prefill replica reached by
a routed call, and the decode engine of the ingress (cluster.http.runner runs each request).

What differs from plain actors (cluster.pd.actor_peers) is how a request travels: the prefill
is one routed call (cancelled if the request is left early, which Serve delivers to the
replica running it), and the decode (or colocated) half runs on an `EngineClient`: the
ingress's own engine with direct streaming (cluster.replica.server, called in process; the
prompt KV then comes back in the prefill's reply into that engine's inbox, kvstore.handoff,
instead of through the store), or the per-step messages of routed engine replicas
(cluster.replica.replica_streams, whose abort is routed to the replica holding the request,
freeing its KV blocks).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import ray

from cluster.pd.flow import pd_flow
from cluster.pd.placement import PrefillUnavailable
from cluster.replica.errors import ReplicaError
from cluster.replica.replica_streams import REPLICA_ERRORS
from engine.engine_client import EngineClient
from engine.engine_request import EngineRequest
from engine.errors import EngineDeadError
from engine.outputs import RequestOutput
from kvstore.handoff import GRPC_MAX_MESSAGE, Inbox, max_reply_kv_bytes


class ServePeers:
    def __init__(self, prefill_handle, decode_streams: EngineClient, store, inbox: Inbox | None = None,
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

    async def prefill(self, request: EngineRequest) -> RequestOutput:
        if self.inbox is None:
            response = self.prefill_handle.prefill.remote(request)
        else:
            # The bound is this process's: its gRPC client is what refuses a reply too big.
            response = self.prefill_handle.prefill_handoff.remote(request, max_reply_kv_bytes())
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
        except EngineDeadError as e:
            # The replica lives but its engine is dead (as decode migration reads it), raised as
            # itself (Serve's gRPC path) or as a RayTaskError of it: nothing was computed, so the
            # prompt runs on its decode engine.
            raise PrefillUnavailable("engine_died", f"prefill replica's engine is dead: {e}") from e
        except REPLICA_ERRORS as e:
            raise ReplicaError(f"prefill replica unavailable: {e}") from e
        except grpc.aio.AioRpcError as e:
            # Serve turns only UNAVAILABLE into ActorUnavailableError. A reply over a channel's
            # limit (RESOURCE_EXHAUSTED: the KV is bounded, so the output itself, e.g. a long
            # prompt's prompt_logprobs) would fail again on a retry: a 500 naming the setting.
            # Any other status fails this request with a retryable 503.
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise RuntimeError(f"the prefill's reply is over the gRPC message limit ({e.details()}); "
                                   f"raise {GRPC_MAX_MESSAGE}") from e
            raise ReplicaError(f"prefill call failed: {e.code().name}: {e.details()}") from e
        except Exception as e:
            # The prefill replica's own failure, which Serve's gRPC path re-raises as itself,
            # not as a RayTaskError: the request failed on a replica (a 503).
            raise ReplicaError(f"prefill failed on its replica: {type(e).__name__}: {e}") from e
        self._open.remove(response)
        if self.inbox is None:
            return out
        if out.handed_off:
            # Before the decode request exists, so its fetch finds it.
            self.inbox.deliver(request.kv_transfer_params.transfer_id, out.value)
            self._handed_off = True
        return out.output

    def decode(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        # The decode engine's own stream, kept to be closed by cleanup (a broken one raises
        # ReplicaError(replica_died=True)).
        self._decoding = self.decode_streams.generate(request)
        return self._decoding

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


class ServePD:
    """The P/D flow behind Serve as one engine (an EngineClient): each request's prefill half
    on a Prefill replica (`prefill_handle`, a routed call), its decode half on `decode` (the
    ingress's own engine, or routed decode replicas). `inbox`: where the decode engine takes
    prompt KV handed back in a prefill's reply (direct streaming), None: the KV goes through
    `store`. `load_failure_policy` decides a prefill that exported no KV."""

    def __init__(self, prefill_handle, decode: EngineClient, store, load_failure_policy: str = "fail",
                 inbox: Inbox | None = None) -> None:
        self.prefill_handle, self.decode, self.store = prefill_handle, decode, store
        self.load_failure_policy, self.inbox = load_failure_policy, inbox

    def generate(self, request: EngineRequest, prefill_timeout_s: float | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs across both halves (pd_flow); its prefill call bounded by
        `prefill_timeout_s` (None: as long as it takes; past it, PrefillUnavailable)."""
        peers = ServePeers(self.prefill_handle, self.decode, self.store, self.inbox, prefill_timeout_s)
        return pd_flow(peers, request, self.load_failure_policy)

    async def pool(self, request: EngineRequest, prefill_timeout_s: float | None = None) -> AsyncIterator[RequestOutput]:
        """A pooling request (an embedding, a score) needs only its prompt's prefill: it runs
        whole on a Prefill replica and its answer is the call's reply; no KV moves. Left
        early, the call is cancelled on its replica."""
        peers = ServePeers(self.prefill_handle, self.decode, self.store, None, prefill_timeout_s)
        finished = False
        try:
            yield await peers.prefill(request)
            finished = True
        finally:
            await peers.cleanup(request.request_id, None, unfinished=not finished)

    async def abort(self, request_id: str) -> None:
        """On the decode engine. A prefill call still running is cancelled when the request's
        stream is closed, as every caller of `generate` does."""
        await self.decode.abort(request_id)

    async def check_health(self) -> None:
        """The decode engine's: Prefill replicas are routed to (Serve checks them), and while
        none is live or soon, a prompt prefills on the decode engine (docs/pd.md)."""
        await self.decode.check_health()
