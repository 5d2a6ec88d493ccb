"""Prompt logprobs: for each prompt position a step computes, the logprob of the prompt's next
token given the prefix, its rank and the top-k (SamplingParams.prompt_logprobs).

They are computed from the step's hidden states, chunk by chunk as the prompt is prefilled,
in slices of at most `_SLICE` positions: memory is bounded by the slice, never a
[prompt_len, vocab] tensor. A request that asks has no prefix-cache hit until its first token
(engine.kv_cache.manager), so every prompt position is computed here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.outputs import Logprob

_SLICE = 256  # positions whose [slice, vocab] logits exist at once


@dataclass(frozen=True)
class PromptSpan:
    """Positions [first, first + count) of request `index` (in the step's order) whose next
    prompt token is scored; they start at `flat` in the step's flattened tokens."""

    index: int
    flat: int
    first: int
    count: int
    k: int  # top-k alternatives


def prompt_spans(params, num_tokens: np.ndarray, num_prompt: np.ndarray, starts: np.ndarray,
                 num_sched: np.ndarray, cu: np.ndarray) -> list[PromptSpan]:
    """The spans of this step: requests that ask, have produced no token yet (after that the
    prompt's logprobs were sent; a resumed request does not score its prompt again), and
    compute positions that have a next prompt token. All arrays are per request in step order."""
    spans = []
    for i, p in enumerate(params):
        if p.prompt_logprobs is None or num_tokens[i] != num_prompt[i]:
            continue
        first = int(starts[i])
        count = min(first + int(num_sched[i]), int(num_prompt[i]) - 1) - first
        if count > 0:
            spans.append(PromptSpan(i, int(cu[i]), first, count, p.prompt_logprobs))
    return spans


def score_prompt(spans: list[PromptSpan], hidden: torch.Tensor, compute_logits, token_ids: np.ndarray,
                 rows: np.ndarray, is_driver: bool) -> dict[int, list[dict[int, Logprob]]]:
    """Per span's request index, the entries of its positions. `compute_logits` runs on every
    rank (under tensor parallelism it gathers); only the driver turns logits into entries."""
    out: dict[int, list[dict[int, Logprob]]] = {}
    for span in spans:
        entries = out.setdefault(span.index, [])
        for lo in range(0, span.count, _SLICE):
            n = min(_SLICE, span.count - lo)
            logits = compute_logits(hidden[span.flat + lo: span.flat + lo + n])
            if not is_driver:
                continue
            pos = span.first + lo
            targets = torch.from_numpy(token_ids[rows[span.index], pos + 1: pos + 1 + n].copy()).to(logits.device)
            entries += _entries(logits, targets, span.k)
    return out


def _entries(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[dict[int, Logprob]]:
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, targets.unsqueeze(1))
    # int32: summing the comparison as int64 (torch's default for bool) takes twice as long.
    ranks = ((lp > chosen).sum(dim=-1, dtype=torch.int32) + 1).tolist()
    chosen = chosen.squeeze(1).tolist()
    top_vals, top_ids = lp.topk(k, dim=-1) if k > 0 else (None, None)
    top_vals = top_vals.tolist() if k > 0 else None
    top_ids = top_ids.tolist() if k > 0 else None
    entries = []
    for j, tok in enumerate(targets.tolist()):
        entry = {tok: Logprob(chosen[j], ranks[j])}
        if k > 0:
            for r, (t, v) in enumerate(zip(top_ids[j], top_vals[j]), start=1):
                entry.setdefault(t, Logprob(v, r))
        entries.append(entry)
    return entries
