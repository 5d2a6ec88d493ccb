"""A request's state inside one EngineCore, and its status state machine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.engine_request import EngineRequest
from engine.kv_transfer_params import KVTransferParams
from engine.lora.request import LoRARequest
from engine.multimodal.features import MultiModalFeatures
from engine.pooling.params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    """Life of a request. Everything above PREEMPTED is finished."""

    WAITING = enum.auto()
    # Its grammar is still compiling (structured outputs); it is skipped until that is done.
    WAITING_FOR_FSM = enum.auto()
    # The connector said the prompt's KV lives elsewhere; blocks are allocated and the
    # request sits here until the load completes (P/D consumer side).
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Request:
    """Scheduler-side view of one request.

    NOTE: `num_computed_tokens` is the single progress counter of the unified compute
    model: prefill, chunked prefill, prefix-cache hits and decode all just advance it
    towards `num_tokens`.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved against max_model_len by the engine
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # for the queue-time metric
    priority: int = 0
    cache_salt: str | None = None
    # P/D state (engine.kv_connector); None for a plain request.
    kv_transfer_params: KVTransferParams | None = None
    # Structured outputs: the constraint and its matcher (set by the engine on add).
    structured_output_request: StructuredOutputRequest | None = None
    # Images: placeholder ranges, hashes, pixels (engine.multimodal); None for text only.
    mm_features: MultiModalFeatures | None = None
    # The adapter it runs with (engine.lora); None: the base model.
    lora_request: LoRARequest | None = None
    # Pooling (engine.pooling): finishes when its prompt is computed, with a vector.
    pooling_params: PoolingParams | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit on first schedule; -1 = not yet known
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Hashes of the full blocks of all_token_ids, extended as tokens are appended.
    block_hashes: list[bytes] = field(default_factory=list)
    # Speculative decoding: drafts the proposer made after the last step, to verify in the
    # next one. NOTE: never part of all_token_ids (so never hashed into the prefix cache).
    spec_token_ids: list[int] = field(default_factory=list)
    # Prompt logprobs computed so far (SamplingParams.prompt_logprobs), sent with the first token.
    prompt_logprob_entries: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @classmethod
    def of(cls, request: EngineRequest) -> Request:
        """The scheduler's state of a checked request (its arrival counted from now: this
        engine's clock, which queue time and priority order are measured on)."""
        return cls(request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
                   sampling_params=request.sampling_params, max_tokens=request.sampling_params.max_tokens,
                   priority=request.priority, cache_salt=request.cache_salt,
                   kv_transfer_params=request.kv_transfer_params, mm_features=request.mm_features,
                   lora_request=request.lora_request, pooling_params=request.pooling_params)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """Whether the token just appended ends the request (EOS, a stop token, a length
        cap); sets the finished status. Stop strings are the output processor's business."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in params._eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def sort_key(self) -> tuple[int, float]:
        """Lower sorts first; the largest key is the first to be preempted."""
        return (self.priority, self.arrival_time)
