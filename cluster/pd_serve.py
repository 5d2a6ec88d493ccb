"""One request over the Prefill and Decode (or Colocated) Serve deployments.

The flow is `actors.orchestrate.pd_flow`; what differs from plain actors is how a request is
stopped: Serve routes every call to whichever replica its router picks, so an abort by
request id could land on the wrong replica. Instead the responses of this request are
cancelled, which Serve delivers to the replica that runs it; there the engine stream closes
and aborts the request (freeing its KV blocks).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import ray

from actors.orchestrate import PDRequestError, pd_flow
from engine.kv_transfer_params import KVTransferParams
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

# Errors meaning the replica (not the request) failed: gone, unreachable, or its engine died
# (the ingress validated the request, so an error raised inside a replica is the replica's).
_REPLICA_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.RayTaskError)


class ServePeers:
    def __init__(self, prefill_handle, decode_handle, store) -> None:
        self.prefill_handle = prefill_handle
        self.decode_handle = decode_handle.options(stream=True)
        self.store = store
        self._open: list = []  # responses that may still be running on a replica

    async def prefill(self, prompt, params: SamplingParams, request_id: str, transfer_id: str) -> RequestOutput:
        response = self.prefill_handle.prefill.remote(prompt, params, request_id, transfer_id)
        self._open.append(response)
        try:
            out = await response
        except _REPLICA_ERRORS as e:
            raise PDRequestError(f"prefill replica unavailable: {e}") from e
        self._open.remove(response)
        return out

    async def decode(self, prompt, params: SamplingParams, request_id: str,
                     kv_params: KVTransferParams) -> AsyncIterator[RequestOutput]:
        stream = self.decode_handle.generate.remote(prompt, params, request_id, kv_params)
        self._open.append(stream)
        try:
            async for out in stream:
                yield out
                if out.finished:
                    self._open.remove(stream)
        except _REPLICA_ERRORS as e:
            raise PDRequestError(f"decode replica unavailable: {e}", replica_died=True) from e

    async def cleanup(self, request_id: str, transfer_id: str | None, unfinished: bool) -> None:
        if unfinished:
            for response in self._open:
                response.cancel()
        self._open.clear()
        if transfer_id is not None:
            await asyncio.gather(self.store.release.remote(transfer_id), return_exceptions=True)


def serve_pd_generate(prefill_handle, decode_handle, store, prompt, params: SamplingParams, request_id: str,
                      load_failure_policy: str = "fail") -> AsyncIterator[RequestOutput]:
    return pd_flow(ServePeers(prefill_handle, decode_handle, store), prompt, params, request_id,
                   load_failure_policy)


async def serve_colocated_generate(handle, prompt, params: SamplingParams, request_id: str
                                   ) -> AsyncIterator[RequestOutput]:
    stream = handle.options(stream=True).generate.remote(prompt, params, request_id)
    finished = False
    try:
        async for out in stream:
            finished = out.finished
            yield out
    except _REPLICA_ERRORS as e:
        raise PDRequestError(f"replica unavailable: {e}") from e
    finally:
        if not finished:
            stream.cancel()
