"""One request over the Prefill and Decode (or Colocated) Serve deployments.

The flow is `actors.orchestrate.pd_flow`; what differs from plain actors is how a request
travels: the prefill is one routed call (cancelled if the request is left early, which Serve
delivers to the replica running it), and the decode (or colocated) half goes over the
per-step messages of cluster.replica.front_streams, whose abort is routed to the replica holding the
request (freeing its KV blocks). With direct streaming the decode engine is the ingress's own,
and the prompt KV comes back in the prefill's reply into that engine's inbox
(kvstore.handoff) instead of through the store.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from actors.orchestrate import PDRequestError, pd_flow
from cluster.replica.front_streams import REPLICA_ERRORS, ReplicaStreams
from engine.kv_transfer_params import KVTransferParams
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from kvstore.handoff import GRPC_MAX_MESSAGE, Inbox, max_reply_kv_bytes


class ServePeers:
    def __init__(self, prefill_handle, decode_streams: ReplicaStreams, store, inbox: Inbox | None = None) -> None:
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


def serve_pd_generate(prefill_handle, decode_streams: ReplicaStreams, store, prompt, params: SamplingParams,
                      request_id: str, load_failure_policy: str = "fail",
                      inbox: Inbox | None = None) -> AsyncIterator[RequestOutput]:
    return pd_flow(ServePeers(prefill_handle, decode_streams, store, inbox), prompt, params, request_id,
                   load_failure_policy)


async def serve_plain_generate(streams: ReplicaStreams, prompt, params: SamplingParams, request_id: str
                               ) -> AsyncIterator[RequestOutput]:
    """A request run whole on one engine replica: every request in colocated mode, and a P/D
    request prefilled on its decode replica (cluster.http.prefill_placement). An engine-side failure
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
