"""Greedy / temperature / top-k / top-p / min-p sampling with per-request seeds and logprobs.

Random rows sample by the exponential race (argmax of p / E with E ~ Exp(1)), which is
multinomial sampling without a host sync per row; a seeded row draws its E from its own
generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import kernels
from engine.sample.penalties import LogitAdjustments

_NEG_INF = float("-inf")


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [N] fp32; 0 for greedy rows
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [N] int64, 0 = disabled
    top_p: torch.Tensor | None = None  # [N] fp32, 1 = disabled
    min_p: torch.Tensor | None = None  # [N] fp32, 0 = disabled
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> RNG
    num_logprobs: list[int | None] = field(default_factory=list)  # per row
    # (row, token ids) whose logits are masked out: EOS/stop tokens before min_tokens, the
    # last tokens of bad words.
    banned_tokens: list[tuple[int, list[int]]] = field(default_factory=list)
    # Allowed tokens, logit_bias and penalties of the rows that ask (engine.sample.penalties).
    adjustments: LogitAdjustments | None = None
    # Structured outputs: grammar_bitmask[i] ([M, ceil(V/32)] int32) says which tokens row
    # grammar_rows[i] ([M] int64) may sample; rows not listed are unconstrained.
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: torch.Tensor | None = None

    @property
    def max_num_logprobs(self) -> int | None:
        wanted = [n for n in self.num_logprobs if n is not None]
        return max(wanted) if wanted else None


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    # Per row: {token_id: logprob} for the sampled token and the top-N, or None.
    logprobs: list[dict[int, float] | None] | None


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()  # [N, V]
        max_lp = meta.max_num_logprobs
        # Logprobs describe the model's own distribution: taken before any processing (the
        # grammar mask included, as vLLM's default logprobs_mode="raw_logprobs").
        raw_logprobs = torch.log_softmax(logits, dim=-1) if max_lp is not None else None
        logits = apply_masks(logits, meta)
        greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            sampled = greedy
        else:
            sampled = torch.where(meta.temperature == 0, greedy, self._sample_random(logits, meta))
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, meta.num_logprobs, max_lp)
        return SamplerOutput(sampled, logprobs)

    def _sample_random(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        probs = target_probs(logits, meta, normalized=False)  # argmax(p / q) needs no sum of 1
        q = torch.empty_like(probs).exponential_()
        for row, gen in meta.generators.items():
            q[row].exponential_(generator=gen)
        return (probs / q).argmax(dim=-1)


def apply_masks(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """`logits` with what a row may not sample at -inf (grammar, then banned tokens), then
    allowed tokens, biases and penalties; a copy when anything changes, so the caller's
    logits stay as they were."""
    if meta.grammar_bitmask is not None or meta.banned_tokens or meta.adjustments is not None:
        logits = logits.clone()
    adjustments = meta.adjustments
    hard = meta.grammar_bitmask is not None or (adjustments is not None and adjustments.allowed is not None)
    if meta.grammar_bitmask is not None:
        # First: temperature, top-k/top-p and min-p then only see tokens the grammar allows.
        kernels.apply_token_bitmask(logits, meta.grammar_bitmask, meta.grammar_rows)
    if adjustments is not None:
        adjustments.mask_allowed(logits)
    for row, token_ids in meta.banned_tokens:
        kept = logits[row, token_ids].clone() if hard else None
        logits[row, token_ids] = _NEG_INF
        if hard and not torch.isfinite(logits[row]).any():
            # The grammar or allowed_token_ids leave only tokens that min_tokens or bad_words
            # ban (a choice already complete, allowed_token_ids of EOS alone): the client's
            # hard constraint wins, so the row is not left with nothing (an all -inf row
            # would sample token 0, outside both).
            logits[row, token_ids] = kept
    if adjustments is not None:
        adjustments.apply(logits, mask_allowed=False)
    return logits


def target_probs(logits: torch.Tensor, meta: SamplingMetadata, normalized: bool = True) -> torch.Tensor:
    """[N, V] distribution each row samples from: temperature, top-k, top-p, then min-p
    (greedy rows: temperature 1). `Sampler` draws from it; the rejection sampler needs it
    normalized (min-p removes mass), the Gumbel-style draw does not."""
    temp = torch.where(meta.temperature == 0, torch.ones_like(meta.temperature), meta.temperature)
    x = logits / temp.unsqueeze(1)
    if meta.top_k is not None or meta.top_p is not None:
        x = apply_top_k_top_p(x, meta.top_k, meta.top_p)
    probs = torch.softmax(x, dim=-1)
    if meta.min_p is not None:
        threshold = meta.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        if normalized:
            probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k, then outside its top-p nucleus.
    The most likely token always survives."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    V = logits.shape[-1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # ties with the k-th are kept
        remove |= sorted_logits < kth
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(remove, _NEG_INF), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Rows with top_p == 1 are exempt: a float cumsum can reach 1.0 before the tail.
        remove |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    remove[:, 0] = False
    return logits.scatter(1, order, sorted_logits.masked_fill(remove, _NEG_INF))


def gather_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, num: list[int | None], max_lp: int
) -> list[dict[int, float] | None]:
    chosen = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()
    top_vals, top_ids = (logprobs.topk(max_lp, dim=-1) if max_lp > 0 else (None, None))
    sampled_list = sampled.tolist()
    out: list[dict[int, float] | None] = []
    for row, n in enumerate(num):
        if n is None:
            out.append(None)
            continue
        entry = {sampled_list[row]: chosen[row]}
        if n > 0:
            for tok, lp in zip(top_ids[row, :n].tolist(), top_vals[row, :n].tolist()):
                entry.setdefault(tok, lp)
        out.append(entry)
    return out
