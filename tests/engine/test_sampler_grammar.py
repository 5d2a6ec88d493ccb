"""The grammar bitmask is applied before temperature / top-k / top-p / min-p, only to the
rows it names, and logprobs stay those of the raw distribution."""

from __future__ import annotations

import torch

from engine.sample.sampler import Sampler, SamplingMetadata

LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0]])


def _bitmask(allowed: list[int]) -> torch.Tensor:
    word = sum(1 << t for t in allowed)
    return torch.tensor([[word]], dtype=torch.int32)


def _draw(n: int, allowed: list[int], **meta_kwargs) -> torch.Tensor:
    torch.manual_seed(0)
    meta = SamplingMetadata(temperature=torch.ones(n), all_greedy=False, grammar_bitmask=_bitmask(allowed).repeat(n, 1),
                            grammar_rows=torch.arange(n), **meta_kwargs)
    return Sampler()(LOGITS.repeat(n, 1), meta).sampled_token_ids


def test_mask_comes_before_top_k_so_the_best_allowed_token_survives():
    # top_k=1 applied first would keep only token 0, which the grammar forbids.
    out = _draw(50, [2, 5], top_k=torch.full((50,), 1))
    assert set(out.tolist()) == {2}


def test_mask_comes_before_top_p_and_min_p():
    out = _draw(400, [3, 4, 6], top_p=torch.full((400,), 0.5))
    assert set(out.tolist()) == {3}  # p(3) > 0.5 among the allowed tokens
    out = _draw(400, [3, 4, 6], min_p=torch.full((400,), 0.5))
    assert set(out.tolist()) == {3, 4}  # p(4)/p(3) = e^-0.5 > 0.5 > p(6)/p(3)


def test_only_the_named_rows_are_masked_and_logprobs_are_raw():
    logits = LOGITS.repeat(2, 1)
    meta = SamplingMetadata(temperature=torch.zeros(2), all_greedy=True, grammar_bitmask=_bitmask([5]),
                            grammar_rows=torch.tensor([1]), num_logprobs=[None, 1])
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == [0, 5]
    raw = torch.log_softmax(LOGITS[0], -1)
    assert out.logprobs[1][5] == float(raw[5]) and out.logprobs[1][0] == float(raw[0])
    assert torch.equal(logits, LOGITS.repeat(2, 1))  # the caller's logits are not modified
