"""Phi-3 and Gemma 2/3 GGUF files, written as llama.cpp's converter writes them: greedy tokens
with chunked prefill and prefix-cache hits equal transformers, on the same file where its GGUF
reader can express the model, else on the HF checkpoint the F32 file was written from (then
the file holds exactly those weights).

transformers' GGUF reader ignores what it has no config key for: Phi-3's rope dimension count
(partial rotary) and LongRoPE factor tensors, and Gemma's soft caps, window pattern, window
rope base and rope scaling (it takes its config classes' defaults: Gemma's
query_pre_attn_scalar 256, Gemma 2's caps 50 and 30, Gemma 3's every-sixth-layer global).
The same-file tests use models within those defaults; the others use the HF checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.gguf_file import gguf_config, hf_pretrained_args
from engine.models.gguf_tokenizer import load_gguf_tokenizer
from tests.engine.gguf_factory import write_gguf
from tests.engine.hf_reference import random_prompts
from tests.engine.test_gguf import SMALL, assert_greedy_parity_chunked_and_cached

# Within transformers' GGUF defaults: 256-wide heads scaled by 1/sqrt(256) (llama.cpp derives
# the scale from the head size), no rope scaling; Gemma 3 with six layers, the sixth global.
GEMMA_SAME_FILE = dict(head_dim=256, query_pre_attn_scalar=256)
GEMMA3_SAME_FILE = dict(GEMMA_SAME_FILE, rope_scaling=None, sliding_window_pattern=6, num_hidden_layers=6,
                        layer_types=None)


def _f32(model_factory, tmp_path, family: str, qtype: str = "F32", **overrides) -> tuple[str, str]:
    hf_dir = model_factory(family, **overrides)
    return hf_dir, write_gguf(hf_dir, str(tmp_path / f"{family}.gguf"), qtype, family)


@pytest.mark.parametrize("variant,overrides,engine_args", [
    # Within the 256-position pretraining length: the short factors.
    ("short", dict(partial_rotary_factor=0.75), {}),
    # An engine longer than the pretraining length (32) runs the long factors throughout, as
    # transformers does once a sequence passes it (every prompt here does).
    ("long", dict(partial_rotary_factor=0.75, original_max_position_embeddings=32), {"max_model_len": 1024}),
])
def test_phi3_longrope_partial_rotary_file_equals_the_hf_checkpoint(model_factory, tmp_path, variant,
                                                                     overrides, engine_args):
    """Fused qkv and gate_up, 12 of 16 head dims rotated, LongRoPE from rope_factors_long and
    rope_factors_short with the file's attention factor."""
    hf_dir, path = _f32(model_factory, tmp_path, "phi3", **overrides)
    cfg = gguf_config(path)
    assert cfg["partial_rotary_factor"] == 0.75 and cfg["rope_scaling"]["rope_type"] == "longrope"
    assert len(cfg["rope_scaling"]["long_factor"]) == 6 and cfg["sliding_window"] is None
    assert_greedy_parity_chunked_and_cached(path, oracle=hf_dir, **engine_args)


def test_phi3_plain_rotary_file_equals_transformers_on_the_same_file(model_factory, tmp_path):
    _, path = _f32(model_factory, tmp_path, "phi3", "Q8_0", rope_scaling=None)
    assert "rope_scaling" not in gguf_config(path)
    assert_greedy_parity_chunked_and_cached(path)


@pytest.mark.parametrize("family,qtype,overrides", [
    ("gemma2", "Q8_0", GEMMA_SAME_FILE),
    ("gemma3", "Q4_1", GEMMA3_SAME_FILE),
])
def test_gemma_file_equals_transformers_on_the_same_file(model_factory, tmp_path, family, qtype, overrides):
    """Norms stored as llama.cpp stores them (HF's w - 1 plus 1), unpermuted q/k, the sandwich
    norms, windows of 16 tokens that the prompts cross, GeGLU, the tied head."""
    _, path = _f32(model_factory, tmp_path, family, qtype, **overrides)
    cfg = gguf_config(path)
    assert cfg["query_pre_attn_scalar"] == 256 and cfg["sliding_window"] == 16
    if family == "gemma3":
        assert cfg["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert_greedy_parity_chunked_and_cached(path)
    # transformers' Gemma tokenizer would add a `<mask>` past this vocabulary; we keep it out.
    assert len(load_gguf_tokenizer(path)) == cfg["vocab_size"]


@pytest.mark.parametrize("family,overrides", [
    # Soft caps other than transformers' defaults: read from the file's keys.
    ("gemma2", dict(attn_logit_softcapping=20.0, final_logit_softcapping=10.0)),
    # Every other layer global (the file's sliding_window_pattern), the global layers' rope
    # base 1e6 scaled linearly by 8, the window layers' base 1e4 unscaled, a final cap.
    ("gemma3", dict(final_logit_softcapping=15.0)),
])
def test_gemma_file_equals_the_hf_checkpoint(model_factory, tmp_path, family, overrides):
    """What transformers' GGUF reader cannot express, against the HF checkpoint. The score
    scale must be 1/sqrt(head_dim): a GGUF file has no key for another (llama.cpp derives it)."""
    hf_dir, path = _f32(model_factory, tmp_path, family, query_pre_attn_scalar=32, **overrides)
    cfg = gguf_config(path)
    if family == "gemma3":
        assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
        assert (cfg["rope_theta"], cfg["rope_local_base_freq"]) == (1e6, 1e4)
        assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert_greedy_parity_chunked_and_cached(path, oracle=hf_dir)
    _assert_logprobs_equal(path, hf_dir)


def _assert_logprobs_equal(path: str, hf_dir: str) -> None:
    """The sampled tokens' logprobs equal transformers' log-softmax of its logits. Greedy
    tokens alone miss a final soft cap (tanh keeps the order), and a tiny Gemma's tied head
    often echoes the last token, whatever the layers do."""
    from transformers import AutoModelForCausalLM

    prompts = random_prompts([7, 30], 1000, seed=6)
    outs = LLM(path, **SMALL).generate([{"prompt_token_ids": p} for p in prompts],
                                       SamplingParams(temperature=0, max_tokens=6, logprobs=3), use_tqdm=False)
    src, kwargs = hf_pretrained_args(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kwargs).eval()
    for p, out in zip(prompts, outs):
        ids = p + list(out.outputs[0].token_ids)
        with torch.no_grad():
            expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        for step, entry in enumerate(out.outputs[0].logprobs):
            for token, lp in entry.items():
                assert abs(lp - float(expected[len(p) - 1 + step, token])) < 1e-3, (step, token)
