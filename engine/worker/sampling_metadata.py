"""Each step's SamplingMetadata, built from the persistent batch's per-request state: the
sampling knobs as tensors, per-request generators, min_tokens and bad-words bans, and the
penalties and biases (engine.sample.penalties)."""

from __future__ import annotations

import numpy as np
import torch

from engine.sample import SamplingMetadata
from engine.sample.penalties import bad_word_bans, build_adjustments
from engine.worker.input_batch import InputBatch


def sampling_metadata(ib: InputBatch, rows: np.ndarray, pos_in_req: np.ndarray, vocab_size: int,
                      device: torch.device) -> SamplingMetadata:
    """Metadata of each logits row: `rows` [N] its input-batch row, `pos_in_req` [N] how
    many of the request's tokens this step comes before it (0 without drafts)."""
    params = [ib.sampling_params[r] for r in rows]
    temps = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
    all_greedy = all(p.greedy for p in params)
    meta = SamplingMetadata(temperature=temps.to(device), all_greedy=all_greedy)
    if not all_greedy:
        if any(p.top_k > 0 for p in params):
            meta.top_k = torch.tensor([p.top_k for p in params], device=device)
        if any(p.top_p < 1.0 for p in params):
            meta.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        if any(p.min_p > 0.0 for p in params):
            meta.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        for j, r in enumerate(rows):
            gen = ib.generators.get(ib.req_ids[r])
            if gen is not None and not params[j].greedy:
                meta.generators[j] = gen
    meta.num_logprobs = [p.logprobs for p in params]
    # Each row's tokens before it: a verified draft's include the drafts ahead of it.
    ends = ib.num_tokens[rows] + pos_in_req
    for j, r in enumerate(rows):
        p = params[j]
        banned = []
        if p.min_tokens and ends[j] - ib.num_prompt_tokens[r] < p.min_tokens:
            banned = sorted(p.all_stop_token_ids)
        if p._bad_words_token_ids:
            banned += bad_word_bans(p, ib.token_ids[r, ib.output_start[r]:ends[j]])
        if banned:
            meta.banned_tokens.append((j, banned))
    meta.adjustments = build_adjustments(params, ib.token_ids, rows, ib.num_prompt_tokens[rows],
                                         ib.output_start[rows], ends, vocab_size, device)
    return meta
