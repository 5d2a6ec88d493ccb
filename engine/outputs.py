"""Outputs handed from the engine to its callers (offline API, async front, actors)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.kv_transfer_params import KVTransferParams
from engine.multimodal.features import MultiModalFeatures

# {token_id: logprob} for the sampled token plus the top-N alternatives at one position.
PositionLogprobs = dict[int, float]


class Logprob(NamedTuple):
    """One token's entry at one prompt position (vLLM's Logprob): its logprob given the
    prefix, its rank in the model's distribution there (1 = most likely), its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# Per prompt position: None for the first token (nothing before it), else {token_id: Logprob}
# for the prompt's own token plus the top-k (vLLM's RequestOutput.prompt_logprobs).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None


@dataclass
class RequestOutput:
    """The state of one request after a step. `outputs[0]` holds everything so far;
    `delta_*` fields hold only what this step added (for streaming)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[PositionLogprobs] | None = None
    kv_transfer_params: KVTransferParams | None = None
    metrics: dict = field(default_factory=dict)
    # The prompt's image placeholders and hashes, never pixels: what a P/D decode side needs
    # to hash its prompt blocks as the prefill side did (vLLM reports placeholders here too).
    multi_modal_features: MultiModalFeatures | None = None
    # When the request asked (SamplingParams.prompt_logprobs): set from the first output on.
    prompt_logprobs: PromptLogprobs | None = None
    # A pooling request's answer (engine.pooling): its embedding or scores, fp32, when finished.
    pooled: torch.Tensor | None = None

    def after(self, earlier: RequestOutput) -> RequestOutput:
        """This output with `earlier`'s deltas in front: two steps' outputs as one (a stream
        whose consumer fell behind catches up in one output)."""
        logprobs = self.delta_logprobs
        if earlier.delta_logprobs:
            logprobs = earlier.delta_logprobs + (logprobs or [])
        return dataclasses.replace(self, delta_text=earlier.delta_text + self.delta_text,
                                   delta_token_ids=earlier.delta_token_ids + self.delta_token_ids,
                                   delta_logprobs=logprobs, metrics={**earlier.metrics, **self.metrics},
                                   prompt_logprobs=self.prompt_logprobs or earlier.prompt_logprobs)


@dataclass(slots=True)
class RequestDelta:
    """What one engine step added to one request: the unit of the per-step message a
    serving replica sends its front end (docs/architecture.md#engine-to-front-end). Deltas only — never the prompt
    or a cumulative list — so its size does not grow with the prompt or the output so far."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[PositionLogprobs] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None
    metrics: dict | None = None
    # Only in the request's first delta (the prompt's logprobs travel once).
    prompt_logprobs: PromptLogprobs | None = None
    pooled: torch.Tensor | None = None  # a pooling request's answer, in its last delta

    @classmethod
    def of(cls, out: RequestOutput) -> RequestDelta:
        c = out.outputs[0]
        # The request's first output is the one whose delta holds every token so far.
        first = len(out.delta_token_ids) == len(c.token_ids)
        return cls(out.request_id, list(out.delta_token_ids), out.delta_text, out.delta_logprobs, out.finished,
                   c.finish_reason if out.finished else None, c.stop_reason if out.finished else None,
                   out.num_cached_tokens, out.kv_transfer_params if out.finished else None, out.metrics or None,
                   out.prompt_logprobs if first else None, out.pooled)

    def merge(self, later: RequestDelta) -> None:
        """Fold a later delta of the same request into this one (coalescing)."""
        self.token_ids += later.token_ids
        self.text += later.text
        if later.logprobs:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.finished, self.finish_reason, self.stop_reason = later.finished, later.finish_reason, later.stop_reason
        self.num_cached_tokens = later.num_cached_tokens
        self.kv_transfer_params = later.kv_transfer_params or self.kv_transfer_params
        if later.metrics:
            self.metrics = {**(self.metrics or {}), **later.metrics}
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        self.pooled = later.pooled if later.pooled is not None else self.pooled


class DeltaAccumulator:
    """The front end's state of one request: rebuilds the cumulative RequestOutput the
    engine would have produced from the stream of its RequestDeltas."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], logprobs: bool) -> None:
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] | None = [] if logprobs else None
        self.prompt_logprobs: PromptLogprobs | None = None

    def add(self, d: RequestDelta) -> RequestOutput:
        self.prompt_logprobs = self.prompt_logprobs or d.prompt_logprobs
        self.token_ids += d.token_ids
        self.text += d.text
        if self.logprobs is not None and d.logprobs:
            self.logprobs += d.logprobs
        # The growing lists themselves, as the engine's own outputs do (no copy per token).
        c = CompletionOutput(0, self.text, self.token_ids, d.finish_reason, d.stop_reason, self.logprobs)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [c], d.finished,
                             d.num_cached_tokens, d.text, d.token_ids, d.logprobs, d.kv_transfer_params,
                             d.metrics or {}, prompt_logprobs=self.prompt_logprobs, pooled=d.pooled)
