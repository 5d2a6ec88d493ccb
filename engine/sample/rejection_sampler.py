"""Verifies draft tokens against the target model's distribution (speculative sampling).

Each speculating request brings k drafts and the target's logits at k + 1 positions: row j
scores the token after draft j - 1 (row 0: after the last accepted token). Draft j is kept
with probability min(1, p_j(d) / q_j(d)); the first rejection is replaced by a sample of the
normalized residual (p_j - q_j)+, and when all k survive a bonus token is drawn from p_k.
Every emitted token is then distributed exactly as under one-token-per-step sampling
(Leviathan et al. 2023, Chen et al. 2023). Greedy rows keep a draft iff it is the argmax,
which makes the greedy output identical to non-speculative decoding.

q is one-hot at the draft for proposers without a distribution (n-gram): the acceptance
probability is then p(d) and the residual is p with the draft's entry removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sample.sampler import SamplingMetadata, apply_masks, gather_logprobs, target_probs


@dataclass
class SpecSamplerOutput:
    # Per request: the accepted drafts followed by the one recovered or bonus token.
    token_ids: list[list[int]]
    # Per request, per emitted token: {token_id: logprob} (emitted + top-N), or None.
    logprobs: list[list[dict[int, float]] | None] | None
    # Per request: how many drafts were accepted (for metrics; before any stop truncation).
    num_accepted: list[int]


def rejection_sample(logits: torch.Tensor, meta: SamplingMetadata, drafts: list[list[int]],
                     draft_probs: torch.Tensor | None = None) -> SpecSamplerOutput:
    """`logits`: [N, V] with N = sum(len(d) + 1 for d in drafts), request i's rows contiguous
    and in order; `meta` describes those N rows (each request's parameters repeated, its
    generator shared by its rows, drawn in row order). `draft_probs` ([N, V], rows without a
    draft ignored): the proposer's q; None means one-hot q (n-gram)."""
    N = logits.shape[0]
    device = logits.device
    logits = logits.float()
    max_lp = meta.max_num_logprobs
    raw_logprobs = torch.log_softmax(logits, dim=-1) if max_lp is not None else None
    logits = apply_masks(logits, meta)

    draft_row = torch.zeros(N, dtype=torch.int64)  # [N] the draft each row verifies (0: none)
    has_draft = torch.zeros(N, dtype=torch.bool)  # [N]
    offsets: list[int] = []
    off = 0
    for d in drafts:
        offsets.append(off)
        if d:
            draft_row[off:off + len(d)] = torch.tensor(d, dtype=torch.int64)
            has_draft[off:off + len(d)] = True
        off += len(d) + 1
    if off != N:
        raise ValueError(f"{N} logits rows for drafts needing {off}")
    draft_row, has_draft = draft_row.to(device), has_draft.to(device)

    greedy = logits.argmax(dim=-1)  # [N]
    if meta.all_greedy:
        accept = has_draft & (greedy == draft_row)
        out = greedy
    else:
        accept, out = _verify_random(logits, meta, draft_row, has_draft, draft_probs)
        is_greedy = meta.temperature == 0
        accept = torch.where(is_greedy, has_draft & (greedy == draft_row), accept)
        out = torch.where(is_greedy, greedy, out)

    accept_l, out_l = accept.tolist(), out.tolist()
    token_ids: list[list[int]] = []
    num_accepted: list[int] = []
    emitted_row = list(out_l)  # [N] the token each row emits, if it emits one
    for d, o in zip(drafts, offsets):
        a = 0
        while a < len(d) and accept_l[o + a]:
            emitted_row[o + a] = d[a]
            a += 1
        num_accepted.append(a)
        token_ids.append(list(d[:a]) + [out_l[o + a]])

    logprobs = None
    if raw_logprobs is not None:
        rows = gather_logprobs(raw_logprobs, torch.tensor(emitted_row, device=device), meta.num_logprobs, max_lp)
        logprobs = [None if rows[o] is None else rows[o:o + len(t)] for t, o in zip(token_ids, offsets)]
    return SpecSamplerOutput(token_ids, logprobs, num_accepted)


def _verify_random(logits, meta, draft_row, has_draft, draft_probs):
    """(accept [N] bool, recovered-or-bonus token [N]) for the sampled rows."""
    p = target_probs(logits, meta)  # [N, V]
    idx = draft_row.unsqueeze(1)
    p_draft = p.gather(1, idx).squeeze(1)  # [N]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        residual = p.scatter(1, idx, 0.0)  # (p - onehot(d))+
    else:
        q = draft_probs.float()
        q_draft = q.gather(1, idx).squeeze(1)
        residual = (p - q).clamp_min(0.0)
    # A row without a draft draws its bonus token from p itself.
    residual = torch.where(has_draft.unsqueeze(1), residual, p)
    # p == q leaves no residual mass, but then the draft is always accepted: any fallback works.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)

    u = torch.rand(p.shape[0], device=p.device)  # [N]
    race = torch.empty_like(p).exponential_()  # [N, V]
    for row, gen in meta.generators.items():
        if has_draft[row]:
            u[row] = torch.rand((), device=p.device, generator=gen)
        race[row].exponential_(generator=gen)
    # u < p/q, written without dividing: accepts with probability min(1, p/q).
    accept = has_draft & (u * q_draft < p_draft)
    return accept, (residual / race).argmax(dim=-1)  # exponential race: a sample of residual
