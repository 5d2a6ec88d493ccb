"""Outputs handed from the engine to its callers (offline API, async front, actors)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv_transfer_params import KVTransferParams

# {token_id: logprob} for the sampled token plus the top-N alternatives at one position.
PositionLogprobs = dict[int, float]


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
