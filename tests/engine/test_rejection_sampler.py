"""The rejection sampler emits tokens distributed exactly as the target's own sampling,
whatever the drafts, and greedy verification keeps a draft iff it is the argmax."""

from __future__ import annotations

import torch

from engine.sample.rejection_sampler import rejection_sample
from engine.sample.sampler import SamplingMetadata, target_probs

V = 6
# The target's logits at the three positions of a 2-draft request (they differ per position).
POS_LOGITS = torch.tensor([
    [2.0, 1.5, 1.0, 0.2, -0.5, -1.0],
    [0.0, 1.0, 2.0, 0.5, 0.3, -2.0],
    [1.0, 1.0, -1.0, 0.0, 2.0, 0.5],
])
N_REQ = 20000
TV_BOUND = 0.02  # the sampling error of 20000 draws over 6 tokens is ~0.006


def _meta(n_rows: int, **kwargs) -> SamplingMetadata:
    return SamplingMetadata(temperature=torch.full((n_rows,), kwargs.pop("temperature", 1.0)),
                            all_greedy=False, **kwargs)


def _meta_rows(n_rows: int, kwargs: dict) -> SamplingMetadata:
    """Metadata of n_rows rows sharing one request's parameters (1-element tensors)."""
    return _meta(n_rows, **{k: v.repeat(n_rows) if torch.is_tensor(v) else v for k, v in kwargs.items()})


def _tv(samples: list[int], probs: torch.Tensor) -> float:
    freq = torch.bincount(torch.tensor(samples), minlength=V).float() / len(samples)
    return 0.5 * float((freq - probs).abs().sum())


def _run(drafts: list[int] | list[list[int]], meta_kwargs: dict, draft_probs: torch.Tensor | None = None):
    """N_REQ requests with the same logits, drafting `drafts` (one list for all, or one per
    request); returns (outputs, target probs per position)."""
    torch.manual_seed(0)
    per_request = drafts if isinstance(drafts[0], list) else [list(drafts)] * N_REQ
    rows = len(per_request[0]) + 1
    logits = POS_LOGITS[:rows].repeat(N_REQ, 1)
    q = None if draft_probs is None else draft_probs[:rows].repeat(N_REQ, 1)
    out = rejection_sample(logits, _meta_rows(N_REQ * rows, meta_kwargs), per_request, q)
    p = target_probs(POS_LOGITS[:rows], _meta_rows(rows, meta_kwargs))
    return out, p


def _check_marginals(out, p, num_drafts: int) -> None:
    """Token 0 ~ p_0; once the first draft is accepted, token 1 ~ p_1 (the model's next-token
    distribution after it); every request emits 1 to num_drafts + 1 tokens."""
    assert all(1 <= len(t) <= num_drafts + 1 for t in out.token_ids)
    assert _tv([t[0] for t in out.token_ids], p[0]) < TV_BOUND
    second = [t[1] for t, a in zip(out.token_ids, out.num_accepted) if a >= 1]
    assert len(second) > 2000
    assert _tv(second, p[1]) < TV_BOUND


def test_ngram_drafts_keep_the_target_distribution():
    drafts = [0, 4]  # a likely then an unlikely guess
    out, p = _run(drafts, {})
    _check_marginals(out, p, 2)
    # Draft 0 is accepted with probability p_0(d_0): the one-hot q acceptance rule.
    accepted_first = sum(1 for a in out.num_accepted if a >= 1) / N_REQ
    assert abs(accepted_first - float(p[0, 0])) < 0.015


def test_drafts_keep_the_distribution_under_temperature_top_k_top_p_min_p():
    drafts = [1, 2]
    kwargs = {"temperature": 0.7, "top_k": torch.tensor([4]), "top_p": torch.tensor([0.9]),
              "min_p": torch.tensor([0.05])}
    out, p = _run(drafts, kwargs)
    assert (p == 0).any(), "the restrictions were meant to cut some tokens"
    _check_marginals(out, p, 2)
    support = set(torch.nonzero(p[0]).flatten().tolist())
    assert {t[0] for t in out.token_ids} <= support


def test_draft_model_probabilities_keep_the_distribution():
    q = torch.softmax(torch.tensor([[0.5, 0.0, 1.5, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 1.0, 0.0, 0.0],
                                    [0.0] * 6]), dim=-1)
    g = torch.Generator().manual_seed(3)
    # A draft model samples its drafts from q.
    drafts = torch.stack([torch.multinomial(q[j], N_REQ, replacement=True, generator=g) for j in range(2)], 1)
    out, p = _run(drafts.tolist(), {}, draft_probs=q)
    _check_marginals(out, p, 2)


def test_always_accepting_sampler_would_fail_the_bound():
    """The oracle can fail: emitting the drafts unchecked is far from p_0."""
    _, p = _run([0, 4], {})
    assert _tv([0] * N_REQ, p[0]) > TV_BOUND


def test_greedy_keeps_drafts_up_to_the_first_mismatch_and_reports_their_logprobs():
    torch.manual_seed(1)
    logits = torch.randn(7, 50)
    argmax = logits.argmax(-1).tolist()
    drafts = [[argmax[0], argmax[1], (argmax[2] + 1) % 50], [], [argmax[5]]]
    meta = SamplingMetadata(temperature=torch.zeros(7), all_greedy=True, num_logprobs=[0] * 7)
    out = rejection_sample(logits, meta, drafts)
    assert out.token_ids == [argmax[0:3], [argmax[4]], argmax[5:7]]
    assert out.num_accepted == [2, 0, 1]
    ref = torch.log_softmax(logits, -1)
    for toks, lps, first in zip(out.token_ids, out.logprobs, (0, 4, 5)):
        for j, (tok, lp) in enumerate(zip(toks, lps)):
            assert abs(lp[tok] - float(ref[first + j, tok])) < 1e-6


def test_seeded_rows_repeat_their_tokens():
    logits = POS_LOGITS.repeat(50, 1)
    outs = []
    for _ in range(2):
        torch.manual_seed(len(outs))  # a different global stream each time
        gens = {i: torch.Generator().manual_seed(7 + i // 3) for i in range(150)}
        meta = _meta(150, generators=gens)
        outs.append(rejection_sample(logits, meta, [[0, 4]] * 50).token_ids)
    assert outs[0] == outs[1]
