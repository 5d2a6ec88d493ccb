"""Parallel sampling (`n` > 1): a front end fans one request out into n child requests.

The engine core schedules only n=1 requests: n samples of one prompt are n independent
sequences (each with its own KV past the shared prompt, which prefix caching shares), so the
fan-out belongs in front of the core, as in vLLM V1. Both front ends use this module: the
offline `LLM.generate` and the HTTP ingress (which streams each child as its own choice).

Seeds: with `seed=s`, child j samples with `seed=s+j`, so the n completions differ from one
another and the whole response is reproducible; child 0 is exactly the n=1 request.
"""

from __future__ import annotations

import dataclasses

from engine.engine_request import EngineRequest
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """The n=1 params of each of `params.n` children (only the seed differs)."""
    if params.n == 1:
        return [params]
    # Only the first child scores the prompt: the others' prompt logprobs would be the same.
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else _wrap_seed(params.seed + j),
                                prompt_logprobs=params.prompt_logprobs if j == 0 else None)
            for j in range(params.n)]


def child_requests(request: EngineRequest, request_ids: list[str] | None = None) -> list[EngineRequest]:
    """A processed request with `n` > 1 as its n children: the same prompt (processed once),
    only their params differ (child_params); `request_ids`: theirs (default: the parent's).
    An n=1 request is its own only child."""
    params = request.sampling_params
    ids = request_ids or [request.request_id] * params.n
    if params.n == 1 and ids[0] == request.request_id:
        return [request]
    return [dataclasses.replace(request, request_id=rid, sampling_params=child)
            for rid, child in zip(ids, child_params(params))]


def child_request_id(parent_id: str, index: int) -> str:
    return f"{index}_{parent_id}"


def merge_children(parent_id: str, children: list[RequestOutput]) -> RequestOutput:
    """One finished RequestOutput whose `outputs` are the children's, as `index` 0..n-1."""
    first = children[0]
    outputs = [dataclasses.replace(child.outputs[0], index=j) for j, child in enumerate(children)]
    return RequestOutput(parent_id, first.prompt, first.prompt_token_ids, outputs,
                         all(c.finished for c in children), first.num_cached_tokens,
                         metrics=first.metrics, multi_modal_features=first.multi_modal_features,
                         prompt_logprobs=first.prompt_logprobs)


def _wrap_seed(seed: int) -> int:
    # seed + j must stay a valid 64-bit seed for the largest user seed (SamplingParams checks it).
    return (seed + 2**63) % 2**64 - 2**63

