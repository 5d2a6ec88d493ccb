"""Arithmetic of the GPU benchmarks (the scripts themselves need a GPU)."""

from __future__ import annotations

import pytest
import torch

from scripts.gpu_roofline import (
    decode_attention_bytes,
    decode_step_bytes,
    model_bandwidth_utilization,
    peak_bandwidth_gbps,
)


def test_peak_bandwidth_lookup_and_override():
    assert peak_bandwidth_gbps("NVIDIA H200") == 4800.0
    assert peak_bandwidth_gbps("NVIDIA H100 80GB HBM3", 1234.0) == 1234.0
    assert peak_bandwidth_gbps("Some GPU") is None


def test_decode_attention_bytes_counts_kv_once_plus_q_and_out():
    # batch 2, ctx 10, 4 q heads, 2 kv heads, dim 8, bf16
    assert decode_attention_bytes(2, 10, 4, 2, 8, 2) == 2 * 2 * 10 * 2 * 8 * 2 + 2 * 2 * 4 * 8 * 2


def test_decode_step_bytes_and_mbu():
    step = decode_step_bytes(1_000_000, [100, 300], num_layers=2, num_kv_heads=2, head_dim=4, itemsize=2)
    assert step == 1_000_000 + 2 * 2 * 2 * 4 * 2 * 400
    assert model_bandwidth_utilization(step, 1e-3, 2.0) == pytest.approx(step / 1e-3 / 2e9)


def test_gpu_parity_judges_every_position_and_fails_on_a_wrong_token(tiny_model):
    """scripts/gpu_parity.py's logic on the CPU: transformers' own greedy tokens all match; a
    token swapped for its least likely one is a mismatch, not a near-tie."""
    from scripts.gpu_parity import agreement, argmaxes, judge
    from tests.engine.hf_reference import _hf_model, random_prompts

    hf = _hf_model(tiny_model)
    prompts = random_prompts([5, 12], 500, seed=3)
    generated = [[a[0]] for a in argmaxes(hf, prompts, [[0] for _ in prompts], "cpu")]
    assert judge(hf, prompts, generated, 1e-3, "cpu")["match"] == 2
    with torch.no_grad():
        worst = hf(torch.tensor([prompts[0]])).logits[0, -1].argmin().item()
    verdict = judge(hf, prompts, [[worst], generated[1]], 1e-3, "cpu")
    assert (verdict["match"], verdict["near_tie"], verdict["mismatch"]) == (1, 0, 1)
    assert agreement([[1, 2], [3]], [[1, 5], [3]]) == 2


def test_parity_real_passes_on_the_tiny_model_and_fails_on_a_wrong_token(tiny_model, capsys, monkeypatch):
    """scripts/parity_real.py's quick mode runs end to end (pdserve and transformers agree on
    every position, exit 0) and exits 1 when one of pdserve's tokens is transformers' least
    likely one; its judge calls such a token a mismatch, not a near-tie, and ends the identical
    prefix there."""
    from scripts import parity_real
    from scripts.parity_real import judge, main, random_prompts
    from tests.engine.hf_reference import _hf_model

    quick = ["--model", tiny_model, "--max-tokens", "8", "--num-prompts", "2"]
    assert main(quick) == 0
    out = capsys.readouterr().out
    assert "positions 16: exact 16, near-ties 0" in out and "mismatches 0" in out
    hf = _hf_model(tiny_model)
    greedy = parity_real.pdserve_greedy

    def last_token_worst(llm, prompts, max_tokens):
        tokens, logprobs, seconds = greedy(llm, prompts, max_tokens)
        with torch.no_grad():
            tokens[0][-1] = hf(torch.tensor([prompts[0] + tokens[0][:-1]])).logits[0, -1].argmin().item()
        return tokens, logprobs, seconds

    monkeypatch.setattr(parity_real, "pdserve_greedy", last_token_worst)
    assert main(quick) == 1
    out = capsys.readouterr().out
    assert "exact 15, near-ties 0" in out and "mismatches 1" in out
    prompts = random_prompts(500, [5, 12], seed=3)
    generated = [[], []]
    with torch.no_grad():  # transformers' own greedy tokens, EOS or not
        for p, g in zip(prompts, generated):
            for _ in range(4):
                g.append(hf(torch.tensor([p + g])).logits[0, -1].argmax().item())
        worst = hf(torch.tensor([prompts[1] + generated[1][:3]])).logits[0, -1].argmin().item()
    verdict = judge(hf, prompts, [generated[0], generated[1][:3] + [worst]])
    assert (verdict["exact"], verdict["near_tie"], verdict["mismatch"]) == (7, 0, 1)
    assert verdict["identical_prefix"] == [4, 3]
