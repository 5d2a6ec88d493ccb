"""P/D and colocated generation over plain Ray actor handles (EngineHost actors): the peers
of cluster.pd.flow.pd_flow as actors, and the colocated baseline."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import ray

from cluster.pd.flow import pd_flow
from cluster.replica.errors import ReplicaError
from engine.engine_request import EngineRequest
from engine.kv_connector import DEFAULT_LOAD_FAILURE_POLICY
from engine.outputs import RequestOutput

__all__ = ["ActorPeers", "colocated_generate", "pd_generate"]


class ActorPeers:
    """The two replicas of one P/D request as plain Ray actor handles (abort by request id)."""

    def __init__(self, prefill, decode, store) -> None:
        self.prefill_actor, self.decode_actor, self.store = prefill, decode, store

    async def prefill(self, request: EngineRequest) -> RequestOutput:
        try:
            return await self.prefill_actor.prefill.remote(request)
        except ray.exceptions.RayActorError as e:
            raise ReplicaError(f"prefill replica died: {e}") from e

    async def decode(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        try:
            async for ref in self.decode_actor.generate.remote(request):
                yield await ref
        except ray.exceptions.RayActorError as e:
            raise ReplicaError(f"decode replica died: {e}", replica_died=True) from e

    async def cleanup(self, request_id: str, transfer_id: str | None, unfinished: bool) -> None:
        calls = []
        if unfinished:
            # Client gone, error or cancellation: nothing of this request may stay anywhere.
            # (Aborting an unknown request is a no-op, so both sides are told.)
            calls += [self.prefill_actor.abort.remote(request_id), self.decode_actor.abort.remote(request_id)]
        if transfer_id is not None:
            calls.append(self.store.release.remote(transfer_id))
        # Waited for (Ray does not order calls to async actors): when the request's generator
        # is closed, the request is gone everywhere. A dead replica's abort just fails.
        await asyncio.gather(*calls, return_exceptions=True)


def pd_generate(prefill, decode, store, request: EngineRequest,
                load_failure_policy: str = DEFAULT_LOAD_FAILURE_POLICY) -> AsyncIterator[RequestOutput]:
    """Disaggregated generation of one request over a prefill and a decode actor handle.
    `load_failure_policy` decides a prefill that exported no KV; the decode actor's own
    (its engine_args.kv_load_failure_policy) decides a load that failed."""
    return pd_flow(ActorPeers(prefill, decode, store), request, load_failure_policy)


async def colocated_generate(worker, request: EngineRequest) -> AsyncIterator[RequestOutput]:
    """The baseline: one worker does prefill and decode."""
    finished = False
    try:
        async for ref in worker.generate.remote(request):
            out = await ref
            finished = out.finished
            yield out
    except ray.exceptions.RayActorError as e:
        raise ReplicaError(f"worker died: {e}") from e
    finally:
        if not finished:
            await asyncio.gather(worker.abort.remote(request.request_id), return_exceptions=True)
