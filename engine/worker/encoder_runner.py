"""The model runner's half of the encoder cache (docs/multimodal.md#scheduling-and-the-encoder-cache): the encoder output tensors, keyed
by image hash, and the slices of them each step's prefill tokens take as embeddings.

The scheduler decides what is encoded and what is dropped; this side only obeys, so the two
never disagree about what the cache holds.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from engine.multimodal.features import MultiModalFeatures
from engine.sched.output import SchedulerOutput


class EncoderRunner:
    def __init__(self, model, device: torch.device) -> None:
        self.model = model  # a LlavaCausalLM: encode_images, embed_input_ids
        self.device = device
        self.cache: dict[str, torch.Tensor] = {}  # mm_hash -> [tokens_per_image, hidden]
        self.features: dict[str, MultiModalFeatures] = {}  # req_id -> placeholders

    def update(self, so: SchedulerOutput) -> float:
        """Apply this step's request changes, drop evicted outputs, encode the scheduled
        images; returns the seconds spent encoding."""
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.features.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            if new.mm_features is not None:
                self.features[new.req_id] = new.mm_features
        for mm_hash in so.free_encoder_mm_hashes:
            self.cache.pop(mm_hash, None)
        if not so.scheduled_encoder_inputs:
            return 0.0
        t0 = time.perf_counter()
        hashes = list(so.scheduled_encoder_inputs)
        pixels = torch.stack([so.scheduled_encoder_inputs[h] for h in hashes]).to(self.device)
        outputs = self.model.encode_images(pixels)  # [N, tokens_per_image, hidden]
        for h, out in zip(hashes, outputs):
            self.cache[h] = out
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the time is the encoder's, not the next kernel's
        return time.perf_counter() - t0

    def merges(self, req_ids: list[str], starts: np.ndarray, num_sched: np.ndarray,
               offsets: np.ndarray) -> list[tuple[int, torch.Tensor]]:
        """(flat token index, embeddings [n, hidden]) for every placeholder scheduled this
        step; `offsets[j]` is request j's first token in the flattened batch."""
        out = []
        for j, req_id in enumerate(req_ids):
            features = self.features.get(req_id)
            if features is None:
                continue
            lo, hi = int(starts[j]), int(starts[j] + num_sched[j])
            for item in features.items:
                if not item.overlaps(lo, hi):
                    continue
                a, b = max(lo, item.offset), min(hi, item.end)
                embeds = self.cache[item.mm_hash][a - item.offset : b - item.offset]
                out.append((int(offsets[j]) + a - lo, embeds))
        return out

    def embed(self, input_ids: torch.Tensor, merges: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """Token embeddings with the placeholders replaced by image embeddings. [T, hidden]"""
        x = self.model.embed_input_ids(input_ids)
        for flat, embeds in merges:
            x[flat : flat + len(embeds)] = embeds.to(x.dtype)
        return x
