"""The flow of one P/D request over any pair of peers (`pd_flow`;
docs/architecture.md#the-path-of-one-request).

The flow yields cumulative RequestOutputs across both halves (cluster/pd/split.py), exactly as
one colocated request would. Whatever ends it (completion, an error on either side, or the
caller going away) it aborts the request on both sides, so no KV block is left. The transfer
is released exactly once: by the decode side's connector once the decode request reached it
(after loading, or when the request ends first), and by this flow only when no decode side
took it over. The peers are plain Ray actors (cluster/pd/actor_peers.py) or Serve deployments
and the ingress's own engine (cluster/pd/serve_peers.py); this module knows no Ray.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Protocol

from cluster.pd.split import decode_request, needs_decode, prefill_request
from cluster.replica.errors import ReplicaError
from engine.engine_request import EngineRequest
from engine.kv_connector import DEFAULT_LOAD_FAILURE_POLICY
from engine.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)


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
        self.prompt_logprobs = first.prompt_logprobs  # the prefill side scored the prompt

    def output(self, finished: bool, finish_reason, stop_reason, delta_text: str, delta_ids: list[int],
               delta_logprobs=None, metrics: dict | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            # The growing list itself, as the engine's own outputs do: copying it for every
            # streamed token would make a long generation quadratic.
            outputs=[CompletionOutput(0, self.text, self.token_ids, finish_reason, stop_reason, self.logprobs)],
            finished=finished, num_cached_tokens=self.num_cached_tokens, delta_text=delta_text,
            delta_token_ids=delta_ids, delta_logprobs=delta_logprobs, metrics=metrics or {},
            prompt_logprobs=self.prompt_logprobs,
        )

    def add(self, out: RequestOutput) -> RequestOutput:
        self.token_ids += out.delta_token_ids
        self.text += out.delta_text
        if self.logprobs is not None and out.delta_logprobs:
            self.logprobs += out.delta_logprobs
        c = out.outputs[0]
        return self.output(out.finished, c.finish_reason, c.stop_reason, out.delta_text,
                           list(out.delta_token_ids), out.delta_logprobs)


class PDPeers(Protocol):
    """The two sides of one P/D request, however they are reached: plain Ray actors
    (ActorPeers), or Serve deployments and the ingress's own engine (ServePeers)."""

    async def prefill(self, request: EngineRequest) -> RequestOutput:
        """Run the prefill half (cluster.pd.split.prefill_request: its kv_transfer_params name
        the transfer); its final output (first token, kv_transfer_params of the export). A
        dead replica raises ReplicaError."""

    def decode(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The decode half's outputs, the prompt KV loaded. A failed replica raises
        ReplicaError (replica_died=True when it may have released nothing)."""

    async def cleanup(self, request_id: str, transfer_id: str | None, unfinished: bool) -> None:
        """Once the request ended: abort it on both sides when `unfinished`, and release
        `transfer_id` when this flow still owns it (None: the decode side did or will)."""


async def pd_flow(peers: PDPeers, request: EngineRequest,
                  load_failure_policy: str = DEFAULT_LOAD_FAILURE_POLICY) -> AsyncIterator[RequestOutput]:
    """Disaggregated generation of one request over any pair of peers. `load_failure_policy`
    decides a prefill that exported no KV (the decode replica's connector decides a load that
    failed: with "fail" its error ends this flow as a ReplicaError, which the ingress answers
    with a 503 and Retry-After)."""
    request_id = request.request_id
    # Named here, so cleanup can release it even when the prefill's result never arrives (the
    # caller gave up while the export was being registered); the store refuses a
    # registration that comes after its release.
    transfer_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
    finished = False
    # Whether this flow still owns the transfer's release: until a decode replica took the
    # request (its connector then releases), or when that replica died with it.
    owns_release = True
    try:
        first = await peers.prefill(prefill_request(request, transfer_id))
        c = first.outputs[0]
        if c.finish_reason == "error":
            raise ReplicaError(f"prefill failed: {c.stop_reason}")
        merged = _Merged(first)
        more = needs_decode(c.finish_reason, request)
        finished = not more
        yield merged.output(not more, c.finish_reason if not more else None, c.stop_reason if not more else None,
                            first.delta_text, list(c.token_ids), first.delta_logprobs, first.metrics)
        if not more:
            return
        if first.kv_transfer_params is None:
            if load_failure_policy != "recompute":
                raise ReplicaError("the prefill exported no KV")
            logger.warning("request %s: no KV was exported; decode recomputes the prompt", request_id)
        owns_release = first.kv_transfer_params is None
        decode_error = None
        try:
            async for out in peers.decode(decode_request(request, first)):
                if out.finished and out.outputs[0].finish_reason == "error":
                    decode_error = out.outputs[0].stop_reason  # its connector released the transfer
                    break
                finished = out.finished
                yield merged.add(out)
        except Exception as e:
            # The decode replica failed (died, or broke the stream): it may have released
            # nothing, so this flow does (a second release would be a no-op in the store).
            if not isinstance(e, ReplicaError) or e.replica_died:
                owns_release = True
            raise
        if decode_error is not None:
            raise ReplicaError(f"decode failed: {decode_error}")
    finally:
        await peers.cleanup(request_id, transfer_id if owns_release else None, not finished)
