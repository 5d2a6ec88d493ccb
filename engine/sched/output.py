"""Typed hand-off objects between the scheduler and the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.kv_transfer_params import KVTransferParams
from engine.lora.request import LoRARequest
from engine.multimodal.features import MultiModalFeatures
from engine.outputs import Logprob, PromptLogprobs
from engine.pooling.params import PoolingParams
from engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Everything the runner needs for a request it has no state for: first schedule, or
    resumption after preemption (then token_ids include the outputs so far)."""

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # P/D state; a consumer's prior output tokens were sampled elsewhere, so its seeded random
    # stream continues past them.
    kv_transfer_params: KVTransferParams | None = None
    # Placeholder ranges and hashes (no pixels: images to encode come in the step's
    # scheduled_encoder_inputs, once per image, not once per request).
    mm_features: MultiModalFeatures | None = None
    # A hybrid model's sliding-window group (engine.kv_cache.manager): its block ids, the null
    # block where blocks fell out of the window; None without one.
    window_block_ids: list[int] | None = None
    lora_request: LoRARequest | None = None  # its adapter (engine.lora), None: the base model
    pooling_params: PoolingParams | None = None  # a pooling request (engine.pooling) never samples


@dataclass
class CachedRequestData:
    """Deltas for requests the runner already holds (one entry per list index)."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # The window group's new block ids per request (hybrid models only; else empty).
    new_window_block_ids: list[list[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # Order of this dict is the order of requests in the flattened batch.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner must drop: finished or aborted since the last step, or preempted.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # The KV connector's instructions for the worker side (engine.kv_connector).
    kv_connector_metadata: object | None = None
    # Structured outputs: the bitmask row of each request that samples under a grammar, and
    # the rows ([rows, ceil(vocab/32)] int32, bit b of word w allows token 32*w + b).
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: np.ndarray | None = None
    # Images to encode before this step's forward (mm_hash -> pixel values [3, H, W]), and
    # encoder outputs the runner may drop (evicted from the encoder cache).
    scheduled_encoder_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    # Speculative decoding: the draft tokens each listed request verifies this step; they are
    # the last len(drafts) of its num_scheduled_tokens (lookahead slots after its last token).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class KVConnectorOutput:
    """What the worker side of a KV connector finished since its last report."""

    # Exports handed off: their blocks may be freed.
    finished_sending: set[str] = field(default_factory=set)
    # Loads written into their blocks: the requests can be scheduled.
    finished_recving: set[str] = field(default_factory=set)
    # Loads that failed, with the reason: the request fails or recomputes (load policy).
    failed_recving: dict[str, str] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving)


@dataclass
class ModelRunnerOutput:
    # One list per scheduled request, in num_scheduled_tokens order; empty when the request
    # did not sample this step (a prefill chunk that does not reach the end of the prompt).
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per request: for each sampled token, {token_id: logprob} (sampled + top-N), or None.
    logprobs: list[list[dict[int, float]] | None] | None = None
    kv_connector_output: KVConnectorOutput | None = None
    encoder_seconds: float = 0.0  # time spent in the vision encoder this step
    # Speculative decoding: per request, the drafts proposed for its next step ([] for none);
    # None when the engine does not speculate.
    spec_token_ids: list[list[int]] | None = None
    # Prompt logprobs of the positions this step computed, by request (in position order).
    prompt_logprobs: dict[str, list[dict[int, Logprob]]] | None = None
    # Pooling requests whose prompt this step finished: their embedding or scores (fp32, CPU).
    pooler_output: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None
    # The whole prompt's, with the request's first token (None for a request that did not ask).
    prompt_logprobs: PromptLogprobs | None = None
    pooled: torch.Tensor | None = None  # a pooling request's answer, with its finish

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
