"""How one request is split into a prefill request and a decode request, and the flow that
runs the two over any pair of peers (`pd_flow`; docs/architecture.md#the-path-of-one-request).

The prefill runs the prompt with max_tokens=1: it samples the first token and exports the
prompt's KV. The decode continues from prompt + [first token] with the prompt's KV loaded and
its own budget reduced by the token already produced, so the concatenated tokens are those a
colocated engine would produce. The flow yields cumulative RequestOutputs across both halves,
exactly as one colocated request would. Whatever ends it (completion, an error on either side,
or the caller going away) it aborts the request on both sides, so no KV block is left. The
transfer is released exactly once: by the decode side's connector once the decode request
reached it (after loading, or when the request ends first), and by this flow only when no
decode side took it over. The peers are plain Ray actors (actors.orchestrate) or Serve
deployments and the ingress's own engine (cluster.http.pd_serve); this module knows no Ray.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Protocol

from engine.kv_connector import DEFAULT_LOAD_FAILURE_POLICY
from engine.kv_transfer_params import KVTransferParams
from engine.outputs import CompletionOutput, RequestOutput
from engine.processor import LORA_FIELD
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class PDRequestError(RuntimeError):
    """A P/D request failed (a replica died, the KV could not be exported or loaded). The
    client gets an error, never tokens computed from wrong or partial KV."""

    def __init__(self, message: str, replica_died: bool = False) -> None:
        super().__init__(message)
        self.replica_died = replica_died


def prefill_kv_params(params: SamplingParams, transfer_id: str | None = None) -> KVTransferParams:
    """The prefill half exports the prompt's KV (under `transfer_id` when the requester names
    it), and, when decode will continue the text, leaves a character split at the first token
    and a possible stop-string prefix to decode instead of emitting them here."""
    return KVTransferParams(do_remote_decode=True, transfer_id=transfer_id,
                            output_continues=params.max_tokens is None or params.max_tokens > 1)


def decode_kv_params(exported: KVTransferParams) -> KVTransferParams:
    """The decode half loads the exported prompt KV; its prompt ends with the one token the
    prefill generated."""
    return dataclasses.replace(exported, num_prior_output_tokens=1)


def prefill_params(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


def needs_decode(first_finish_reason: str | None, params: SamplingParams) -> bool:
    """Whether anything is left after the prefill's single token. The prefill always stops at
    max_tokens=1 ("length"); it is the real end only if the user asked for one token."""
    if first_finish_reason != "length":
        return False  # EOS, stop token/string, error, abort
    return params.max_tokens is None or params.max_tokens > 1


def decode_params(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(
        params,
        max_tokens=None if params.max_tokens is None else params.max_tokens - 1,
        min_tokens=max(params.min_tokens - 1, 0),
        prompt_logprobs=None,  # the prefill side computed them; decode loads the prompt's KV
    )


def decode_prompt(prompt_token_ids: list[int], first_token: int, mm_features=None, lora_request=None) -> dict:
    """The decode request's prompt. With images it carries their placeholders and hashes
    (MultiModalFeatures without pixels): decode never encodes, it loads the prompt's KV, but
    it hashes its blocks by image as the prefill did. With a LoRA adapter it names it, so
    decode runs the adapter the prefill ran (and checks the transfer was made with it)."""
    prompt = {"prompt_token_ids": list(prompt_token_ids) + [first_token]}
    if mm_features is not None:
        prompt["multi_modal_features"] = mm_features
    if lora_request is not None:
        prompt[LORA_FIELD] = lora_request
    return prompt


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
    (ActorPeers), or Serve deployments and the ingress's own engine (cluster.http.pd_serve)."""

    async def prefill(self, prompt, params: SamplingParams, request_id: str, transfer_id: str) -> RequestOutput:
        """Run the prompt with max_tokens=1 and export its KV as `transfer_id`; its output
        (first token, kv_transfer_params). A dead replica raises PDRequestError."""

    def decode(self, prompt, params: SamplingParams, request_id: str,
               kv_params: KVTransferParams) -> AsyncIterator[RequestOutput]:
        """The rest of the request with the prompt KV loaded. A failed replica raises
        PDRequestError (replica_died=True when it may have released nothing)."""

    async def cleanup(self, request_id: str, transfer_id: str | None, unfinished: bool) -> None:
        """Once the request ended: abort it on both sides when `unfinished`, and release
        `transfer_id` when this flow still owns it (None: the decode side did or will)."""


async def pd_flow(peers: PDPeers, prompt, params: SamplingParams, request_id: str,
                  load_failure_policy: str = DEFAULT_LOAD_FAILURE_POLICY) -> AsyncIterator[RequestOutput]:
    """Disaggregated generation of one request over any pair of peers (actor handles here,
    Serve deployment handles in cluster.http.pd_serve). `load_failure_policy` decides a
    prefill that exported no KV (the decode replica's connector decides a load that failed:
    with "fail" its error ends this flow as a PDRequestError, which the ingress answers with
    a 503 and Retry-After)."""
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
            lora = prompt.get(LORA_FIELD) if isinstance(prompt, dict) else None
            async for out in peers.decode(decode_prompt(first.prompt_token_ids, c.token_ids[0],
                                                        first.multi_modal_features, lora),
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
