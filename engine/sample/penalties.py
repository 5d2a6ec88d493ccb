"""Penalties and biases on a batch's logits: allowed tokens, logit_bias, then repetition,
frequency and presence penalties, each a few tensor ops over the whole batch.

vLLM's order: these come after the grammar mask and the min_tokens/bad-words bans and before
temperature, top-k, top-p and min-p. Repetition follows Hugging Face (tokens of the prompt or
the output: a positive logit is divided by the penalty, a negative one multiplied);
frequency and presence follow OpenAI (over generated tokens: logit -= frequency * count +
presence * [count > 0]).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class LogitAdjustments:
    """One step's adjustments; every tensor has a row per logits row that has one (`rows`)."""

    rows: torch.Tensor  # [M] int64 logits rows with any adjustment
    repetition: torch.Tensor | None = None  # [M] fp32, 1 = none
    frequency: torch.Tensor | None = None  # [M] fp32
    presence: torch.Tensor | None = None  # [M] fp32
    output_counts: torch.Tensor | None = None  # [M, V] fp32, times each token was generated
    seen: torch.Tensor | None = None  # [M, V] bool, in the prompt or the output (repetition)
    # logit_bias as a sparse add: (index into rows, token ids, biases).
    bias_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    allowed: torch.Tensor | None = None  # [M, V] bool; rows without a list allow everything

    def mask_allowed(self, logits: torch.Tensor) -> None:
        """allowed_token_ids alone, in place: a hard mask, applied with the grammar's, before the
        min_tokens and bad-words bans (engine.sample.sampler.apply_masks)."""
        if self.allowed is not None:
            sub = logits[self.rows]
            sub.masked_fill_(~self.allowed, _NEG_INF)
            logits[self.rows] = sub

    def apply(self, logits: torch.Tensor, mask_allowed: bool = True) -> None:
        """In place on `logits` [N, V] (the caller's copy); `mask_allowed=False` when
        `mask_allowed` ran already."""
        sub = logits[self.rows]
        if self.allowed is not None and mask_allowed:
            sub.masked_fill_(~self.allowed, _NEG_INF)
        if self.bias_index is not None:
            i, tok, bias = self.bias_index
            sub.index_put_((i, tok), bias, accumulate=True)
        if self.repetition is not None:
            p = self.repetition.unsqueeze(1)
            penalized = torch.where(sub > 0, sub / p, sub * p)
            sub = torch.where(self.seen, penalized, sub)
        if self.frequency is not None:
            sub -= self.frequency.unsqueeze(1) * self.output_counts
            sub -= self.presence.unsqueeze(1) * (self.output_counts > 0)
        logits[self.rows] = sub


def build_adjustments(params: Sequence[SamplingParams], token_ids: np.ndarray, batch_rows: np.ndarray,
                      prompt_lens: np.ndarray, output_starts: np.ndarray, ends: np.ndarray, vocab_size: int,
                      device: torch.device) -> LogitAdjustments | None:
    """The adjustments of the logits rows whose params ask for any, or None.

    Logits row j belongs to input-batch row batch_rows[j], whose tokens are
    token_ids[batch_rows[j], :ends[j]]: the prompt is [:prompt_lens[j]], the generated tokens
    [output_starts[j]:ends[j]] (a P/D decode side counts the prefill's first token, which sits
    in its prompt; a verified draft counts the drafts before it). Only the rows that ask are
    read, and only up to their ends."""
    rows = [j for j, p in enumerate(params) if p.penalized]
    if not rows:
        return None
    ps = [params[j] for j in rows]
    M, V = len(rows), vocab_size
    adj = LogitAdjustments(rows=torch.tensor(rows, dtype=torch.int64, device=device))
    if any(p.allowed_token_ids is not None for p in ps):
        allowed = torch.ones((M, V), dtype=torch.bool)
        for i, p in enumerate(ps):
            if p.allowed_token_ids is not None:
                allowed[i] = False
                allowed[i, p.allowed_token_ids] = True
        adj.allowed = allowed.to(device)
    if any(p.logit_bias for p in ps):
        idx, tok, bias = [], [], []
        for i, p in enumerate(ps):
            for t, b in (p.logit_bias or {}).items():
                idx.append(i)
                tok.append(t)
                bias.append(b)
        adj.bias_index = (torch.tensor(idx, dtype=torch.int64, device=device),
                          torch.tensor(tok, dtype=torch.int64, device=device),
                          torch.tensor(bias, dtype=torch.float32, device=device))
    sel = np.asarray(rows)
    rep = any(p.repetition_penalty != 1.0 for p in ps)
    freq = any(p.frequency_penalty or p.presence_penalty for p in ps)
    if rep or freq:
        tokens = token_ids[batch_rows[sel], :int(ends[sel].max())]
        counts = _output_counts(tokens, output_starts[sel], ends[sel], V)
        if freq:
            adj.frequency = torch.tensor([p.frequency_penalty for p in ps], dtype=torch.float32, device=device)
            adj.presence = torch.tensor([p.presence_penalty for p in ps], dtype=torch.float32, device=device)
            adj.output_counts = counts.to(device)
        if rep:
            adj.repetition = torch.tensor([p.repetition_penalty for p in ps], dtype=torch.float32, device=device)
            adj.seen = ((counts > 0) | _prompt_mask(tokens, prompt_lens[sel], V)).to(device)
    return adj


def _output_counts(tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray, V: int) -> torch.Tensor:
    """[M, V] fp32: how often each token occurs in tokens[i, starts[i]:ends[i]]."""
    M = len(tokens)
    width = int((ends - starts).max(initial=0))
    counts = torch.zeros((M, V + 1), dtype=torch.float32)  # column V takes the padding
    if width > 0:
        cols = starts[:, None] + np.arange(width)[None, :]
        valid = cols < ends[:, None]
        ids = np.where(valid, np.take_along_axis(tokens, np.minimum(cols, tokens.shape[1] - 1), axis=1), V)
        counts.scatter_add_(1, torch.from_numpy(ids), torch.ones(ids.shape, dtype=torch.float32))
    return counts[:, :V]


def _prompt_mask(tokens: np.ndarray, prompt_lens: np.ndarray, V: int) -> torch.Tensor:
    M = len(tokens)
    width = int(prompt_lens.max(initial=0))
    mask = torch.zeros((M, V + 1), dtype=torch.bool)
    if width > 0:
        cols = np.arange(width)[None, :]
        ids = np.where(cols < prompt_lens[:, None], tokens[:, :width], V)
        mask.scatter_(1, torch.from_numpy(ids), True)
    return mask[:, :V]


def bad_word_bans(params: SamplingParams, generated: np.ndarray) -> list[int]:
    """Token ids `params`'s bad words forbid next, after the generated tokens `generated`:
    each word's last token where the tokens before it were just generated."""
    banned = []
    for seq in params._bad_words_token_ids:
        prefix = seq[:-1]
        if len(prefix) <= len(generated) and (not prefix or tuple(generated[len(generated) - len(prefix):]) == prefix):
            banned.append(seq[-1])
    return banned
