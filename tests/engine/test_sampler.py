"""Sampling restricts support as configured, follows the distribution, and a seed fixes a
request's tokens whatever else is in the batch."""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.sample.sampler import Sampler, SamplingMetadata, apply_top_k_top_p
from tests.engine.hf_reference import random_prompts

LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0]])


def _draw(meta_kwargs: dict, n: int = 4000, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    torch.manual_seed(0)
    batch = logits.repeat(n, 1)
    meta = SamplingMetadata(temperature=torch.ones(n), all_greedy=False, **meta_kwargs)
    return Sampler()(batch, meta).sampled_token_ids


def test_top_k_keeps_exactly_k_tokens():
    out = apply_top_k_top_p(LOGITS, torch.tensor([3]), None)
    assert torch.isfinite(out).sum() == 3
    assert torch.isfinite(out[0, :3]).all()


def test_top_p_keeps_smallest_nucleus_reaching_p():
    probs = torch.softmax(LOGITS, -1)[0]
    p = float(probs[:2].sum()) - 1e-3  # the top two tokens are needed to pass p
    out = apply_top_k_top_p(LOGITS, None, torch.tensor([p]))
    assert torch.isfinite(out).sum() == 2


def test_top_p_of_one_keeps_everything():
    out = apply_top_k_top_p(LOGITS, None, torch.tensor([1.0]))
    assert torch.isfinite(out).all()


def test_top_k_samples_stay_in_support():
    drawn = _draw({"top_k": torch.full((4000,), 2)})
    assert set(drawn.tolist()) == {0, 1}


def test_top_p_samples_stay_in_support():
    probs = torch.softmax(LOGITS, -1)[0]
    p = float(probs[:3].sum()) - 1e-3
    drawn = _draw({"top_p": torch.full((4000,), p)})
    assert set(drawn.tolist()) == {0, 1, 2}


def test_min_p_samples_stay_in_support():
    probs = torch.softmax(LOGITS, -1)[0]
    min_p = float(probs[3] / probs[0]) - 1e-4  # keeps tokens 0..3
    drawn = _draw({"min_p": torch.full((4000,), min_p)})
    assert set(drawn.tolist()) == {0, 1, 2, 3}


def test_random_sampling_follows_softmax_distribution():
    drawn = _draw({}, n=20000)
    freq = torch.bincount(drawn, minlength=8).float() / 20000
    expected = torch.softmax(LOGITS, -1)[0]
    # 20k draws: standard error <= 0.0036; allow 4 sigma.
    assert torch.allclose(freq, expected, atol=0.015)


def test_temperature_sharpens_distribution():
    meta = SamplingMetadata(temperature=torch.full((20000,), 0.25), all_greedy=False)
    torch.manual_seed(0)
    drawn = Sampler()(LOGITS.repeat(20000, 1), meta).sampled_token_ids
    freq = torch.bincount(drawn, minlength=8).float() / 20000
    assert torch.allclose(freq, torch.softmax(LOGITS / 0.25, -1)[0], atol=0.015)


def test_greedy_rows_take_argmax_in_mixed_batch():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    meta = SamplingMetadata(temperature=torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0]), all_greedy=False)
    out = Sampler()(logits, meta).sampled_token_ids
    assert out[0::2].tolist() == logits[0::2].argmax(-1).tolist()


def test_banned_tokens_are_never_sampled():
    meta = SamplingMetadata(temperature=torch.zeros(1), all_greedy=True, banned_tokens=[(0, [0])])
    assert Sampler()(LOGITS, meta).sampled_token_ids.item() == 1


def test_logprobs_include_sampled_and_top_n():
    meta = SamplingMetadata(temperature=torch.zeros(1), all_greedy=True, num_logprobs=[3])
    out = Sampler()(LOGITS, meta)
    lp = out.logprobs[0]
    ref = torch.log_softmax(LOGITS, -1)[0]
    assert list(lp) == [0, 1, 2]
    assert all(abs(lp[t] - ref[t].item()) < 1e-6 for t in lp)


def _seeded_tokens(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_seed_gives_same_tokens_whatever_the_batch(tiny_model):
    llm = LLM(tiny_model, max_model_len=256)
    prompts = random_prompts([12, 30, 7, 50], 1000, seed=7)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24)
    alone = _seeded_tokens(llm, [prompts[0]], [seeded])[0]
    others = [SamplingParams(temperature=0.8, max_tokens=30), SamplingParams(temperature=0, max_tokens=5),
              SamplingParams(temperature=1.2, top_k=5, max_tokens=12)]
    in_batch = _seeded_tokens(llm, [prompts[1], prompts[0], prompts[2], prompts[3]],
                              [others[0], seeded, others[1], others[2]])[1]
    assert in_batch == alone


def test_different_seeds_give_different_tokens(tiny_model):
    llm = LLM(tiny_model, max_model_len=256)
    prompt = random_prompts([12], 1000, seed=8)
    a = _seeded_tokens(llm, prompt, SamplingParams(temperature=1.5, seed=1, max_tokens=24))
    b = _seeded_tokens(llm, prompt, SamplingParams(temperature=1.5, seed=2, max_tokens=24))
    assert a != b
