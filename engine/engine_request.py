"""EngineRequest: one request as every engine takes it.

It is built once, by an `InputProcessor` (engine/processor.py), at the first front end the
request reaches: the HTTP ingress, `LLM.generate`, a batch row. Tokenization, the chat
template, images and the default `max_tokens` are settled there. Every engine after it (the
ingress's own, a prefill replica, a decode replica, a core process) checks it against its own
limits (`InputProcessor.check`) and runs it as it is: nothing is tokenized twice. A P/D split
derives its two halves from it (cluster/pd/split.py) with `dataclasses.replace`.

NOTE: an EngineRequest is not changed after it is built (its lists included); a hop that needs
another one makes a copy with `dataclasses.replace`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.kv_transfer_params import KVTransferParams
from engine.lora.request import LoRARequest
from engine.multimodal.features import MultiModalFeatures
from engine.pooling.params import PoolingParams
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]  # image placeholders expanded
    # Resolved: max_tokens is set (the API's default, or the room left in the context), the
    # model's EOS ids and the bad words' token ids are filled in.
    sampling_params: SamplingParams
    prompt: str | None = None  # the prompt's text, when it came as text (echo, outputs)
    lora_request: LoRARequest | None = None  # None: the base model
    # Images: placeholder ranges, hashes and pixels (a P/D decode half: no pixels).
    mm_features: MultiModalFeatures | None = None
    kv_transfer_params: KVTransferParams | None = None  # P/D state; None: a plain request
    priority: int = 0  # lower runs first (--scheduling-policy priority)
    cache_salt: str | None = None  # separates prefix-cache entries of different tenants
    arrival_time: float = field(default_factory=time.time)  # wall clock, at the front end
    # A pooling request (engine.pooling): prefill only, its answer a vector, never a token.
    pooling_params: PoolingParams | None = None

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens
