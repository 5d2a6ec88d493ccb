"""One request through prefill and decode replicas (ARCHITECTURE.md §2, steps 2-5).

`pd_generate` is what the ingress calls: prefill with max_tokens=1 -> first token +
kv_transfer_params -> decode with the prompt KV loaded. It yields cumulative RequestOutputs
whose token ids and text run across both halves, exactly as one colocated request would.
Whatever ends it — completion, an error on either side, or the caller going away — it aborts
the request on both replicas, so no KV block is left. The transfer is released exactly once:
by the decode replica's connector once the decode request reached it (after loading, or when
the request ends first), and by this flow only when no decode replica took it over.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

import ray

from engine.kv_transfer_params import KVTransferParams
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from kvstore.pd import decode_kv_params, decode_params, decode_prompt, needs_decode

logger = logging.getLogger(__name__)


class PDRequestError(RuntimeError):
    """A P/D request failed (a replica died, the KV could not be exported or loaded). The
    client gets an error, never tokens computed from wrong or partial KV."""

    def __init__(self, message: str, replica_died: bool = False) -> None:
        super().__init__(message)
        self.replica_died = replica_died


class _Merged:
    """Accumulates the prefill output and the decode stream into one request's view."""

    def __init__(self, first: RequestOutput) -> None:
        c = first.outputs[0]
        self.request_id = first.request_id
        self.prompt = first.prompt
        self.prompt_token_ids = first.prompt_token_ids
        self.token_ids = list(c.token_ids)
        # What the prefill emitted: when decode continues, a possible stop-string prefix (or
        # a split character) at its end is held back and sent by decode instead.
        self.text = first.delta_text
        self.logprobs = list(c.logprobs) if c.logprobs is not None else None
        self.num_cached_tokens = first.num_cached_tokens

    def output(self, finished: bool, finish_reason, stop_reason, delta_text: str, delta_ids: list[int],
               delta_logprobs=None, metrics: dict | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            # The growing list itself, as the engine's own outputs do: copying it for every
            # streamed token would make a long generation quadratic.
            outputs=[CompletionOutput(0, self.text, self.token_ids, finish_reason, stop_reason, self.logprobs)],
            finished=finished, num_cached_tokens=self.num_cached_tokens, delta_text=delta_text,
            delta_token_ids=delta_ids, delta_logprobs=delta_logprobs, metrics=metrics or {},
        )

    def add(self, out: RequestOutput) -> RequestOutput:
        self.token_ids += out.delta_token_ids
        self.text += out.delta_text
        if self.logprobs is not None and out.delta_logprobs:
            self.logprobs += out.delta_logprobs
        c = out.outputs[0]
        return self.output(out.finished, c.finish_reason, c.stop_reason, out.delta_text,
                           list(out.delta_token_ids), out.delta_logprobs)


class ActorPeers:
    """The two replicas of one P/D request as plain Ray actor handles (abort by request id)."""

    def __init__(self, prefill, decode, store) -> None:
        self.prefill_actor, self.decode_actor, self.store = prefill, decode, store

    async def prefill(self, prompt, params: SamplingParams, request_id: str, transfer_id: str) -> RequestOutput:
        try:
            return await self.prefill_actor.prefill.remote(prompt, params, request_id, transfer_id)
        except ray.exceptions.RayActorError as e:
            raise PDRequestError(f"prefill replica died: {e}") from e

    async def decode(self, prompt, params: SamplingParams, request_id: str,
                     kv_params: KVTransferParams) -> AsyncIterator[RequestOutput]:
        try:
            async for ref in self.decode_actor.generate.remote(prompt, params, request_id, kv_params):
                yield await ref
        except ray.exceptions.RayActorError as e:
            raise PDRequestError(f"decode replica died: {e}", replica_died=True) from e

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


async def pd_flow(peers, prompt, params: SamplingParams, request_id: str,
                  load_failure_policy: str = "fail") -> AsyncIterator[RequestOutput]:
    """Disaggregated generation of one request over any pair of peers (actor handles here,
    Serve deployment handles in cluster.http.pd_serve)."""
    # Named here, so cleanup can release it even when the prefill's result never arrives (the
    # caller gave up while the export was being registered); the store refuses a
    # registration that comes after its release.
    transfer_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
    finished = False
    # Whether this flow still owns the transfer's release: until a decode replica took the
    # request (its connector then releases), or when that replica died with it.
    owns_release = True
    try:
        first = await peers.prefill(prompt, params, request_id, transfer_id)
        c = first.outputs[0]
        if c.finish_reason == "error":
            raise PDRequestError(f"prefill failed: {c.stop_reason}")
        merged = _Merged(first)
        more = needs_decode(c.finish_reason, params)
        finished = not more
        yield merged.output(not more, c.finish_reason if not more else None, c.stop_reason if not more else None,
                            first.delta_text, list(c.token_ids), first.delta_logprobs, first.metrics)
        if not more:
            return
        exported = first.kv_transfer_params
        if exported is None:
            if load_failure_policy != "recompute":
                raise PDRequestError("the prefill exported no KV")
            logger.warning("request %s: no KV was exported; decode recomputes the prompt", request_id)
        # The decode request carries the transfer (its prompt KV) and the prior token either way.
        kv_params = decode_kv_params(exported or KVTransferParams())
        owns_release = exported is None
        decode_error = None
        try:
            async for out in peers.decode(decode_prompt(first.prompt_token_ids, c.token_ids[0],
                                                        first.multi_modal_features),
                                          decode_params(params), request_id, kv_params):
                if out.finished and out.outputs[0].finish_reason == "error":
                    decode_error = out.outputs[0].stop_reason  # its connector released the transfer
                    break
                finished = out.finished
                yield merged.add(out)
        except Exception as e:
            # The decode replica failed (died, or broke the stream): it may have released
            # nothing, so this flow does (a second release would be a no-op in the store).
            if not isinstance(e, PDRequestError) or e.replica_died:
                owns_release = True
            raise
        if decode_error is not None:
            raise PDRequestError(f"decode failed: {decode_error}")
    finally:
        await peers.cleanup(request_id, transfer_id if owns_release else None, not finished)


def pd_generate(prefill, decode, store, prompt, params: SamplingParams, request_id: str,
                load_failure_policy: str = "fail") -> AsyncIterator[RequestOutput]:
    """Disaggregated generation of one request over a prefill and a decode actor handle."""
    return pd_flow(ActorPeers(prefill, decode, store), prompt, params, request_id, load_failure_policy)


async def colocated_generate(worker, prompt, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
    """The baseline: one worker does prefill and decode."""
    finished = False
    try:
        async for ref in worker.generate.remote(prompt, params, request_id):
            out = await ref
            finished = out.finished
            yield out
    except ray.exceptions.RayActorError as e:
        raise PDRequestError(f"worker died: {e}") from e
    finally:
        if not finished:
            await asyncio.gather(worker.abort.remote(request_id), return_exceptions=True)
