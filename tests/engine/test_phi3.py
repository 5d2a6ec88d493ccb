"""Phi-3 checkpoints (Phi3ForCausalLM: Phi-3/3.5-mini, Phi-4-mini): fused qkv and gate_up
tensors, partial rotary and LongRoPE, against transformers running the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.arch import arch_from_dict, load_arch
from engine.models.rotary import cos_sin_cache
from tests.engine.hf_reference import hf_greedy, random_prompts

MAX_NEW = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
# The tiny preset: max_position_embeddings 1024, LongRoPE's original length 256 by default.
VARIANTS = {
    "plain": dict(rope_scaling=None),
    "partial-rotary": dict(rope_scaling=None, partial_rotary_factor=0.75),
    "longrope": {},
    "longrope-partial-rotary": dict(partial_rotary_factor=0.75),
}
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=128, architectures=["Phi3ForCausalLM"], max_position_embeddings=1024)


def _generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_transformers(model_factory, variant):
    model = model_factory("phi3", **VARIANTS[variant])
    llm = LLM(model, max_model_len=256)
    prompts = random_prompts([3, 17, 40, 90, 5, 64], 1000)
    assert _generate(llm, prompts) == hf_greedy(model, prompts, MAX_NEW)


def test_longrope_past_the_original_length_uses_the_long_factors_like_transformers(model_factory):
    # max_model_len beyond the pretraining length (64): the long factors for every position, as
    # transformers runs a sequence longer than it (prompts past 64 tokens), chunked prefill on.
    model = model_factory("phi3", partial_rotary_factor=0.75, original_max_position_embeddings=64)
    llm = LLM(model, max_model_len=256, long_prefill_token_threshold=7, max_num_batched_tokens=24)
    prompts = random_prompts([65, 90, 130], 1000, seed=5)
    assert _generate(llm, prompts) == hf_greedy(model, prompts, MAX_NEW)


def test_longrope_matches_transformers_with_chunked_prefill_and_prefix_cache_hits(model_factory):
    model = model_factory("phi3", partial_rotary_factor=0.75)
    llm = LLM(model, max_model_len=256, long_prefill_token_threshold=7, max_num_batched_tokens=24,
              enable_prefix_caching=True)
    shared = random_prompts([48], 1000, seed=3)[0]
    prompts = [shared + tail for tail in random_prompts([1, 9, 30], 1000, seed=4)]
    first = _generate(llm, prompts)
    second = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= 48 for o in second)
    assert [o.outputs[0].token_ids for o in second] == first == hf_greedy(model, prompts, MAX_NEW)


def test_longrope_table_equals_transformers_cos_sin_on_both_sides_of_the_original_length(model_factory):
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    model = model_factory("phi3", partial_rotary_factor=0.75)
    arch = load_arch(model)
    rope = Phi3RotaryEmbedding(AutoConfig.from_pretrained(model))
    x = torch.zeros(1, dtype=torch.float32)
    half = arch.rotary_dim // 2
    # An engine whose context fits the original 256 positions: the short factors; a longer one:
    # the long factors, which transformers uses once a sequence passes 256 positions.
    for max_model_len, last in ((256, 200), (1024, 1000)):
        ours = cos_sin_cache(arch.rotary_dim, max_model_len, arch.rope_theta, arch.rope_scaling_dict)
        positions = torch.arange(last - 20, last)
        cos, sin = rope(x, positions[None])
        assert torch.equal(ours[positions], torch.cat((cos[0, :, :half], sin[0, :, :half]), -1))


def test_su_is_longrope_and_the_attention_factor_follows_the_context_ratio():
    factors = dict(short_factor=[1.0] * 8, long_factor=[2.0] * 8)
    arch = arch_from_dict({**BASE, "original_max_position_embeddings": 256,
                           "rope_scaling": {"type": "su", **factors}})
    scaling = arch.rope_scaling_dict
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 256
    # ln(1024 / 256) / ln(256) = 1/4
    assert scaling["attention_factor"] == pytest.approx(1.25**0.5)
    given = arch_from_dict({**BASE, "rope_scaling": {"type": "longrope", "attention_factor": 1.5, **factors}})
    assert given.rope_scaling_dict["attention_factor"] == 1.5


def test_longrope_factor_count_must_match_the_rotary_dim():
    with pytest.raises(ValueError, match="short_factor must hold 6 factors"):
        arch_from_dict({**BASE, "partial_rotary_factor": 0.75,
                        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 6}})


def test_unsupported_activation_is_refused_by_name():
    with pytest.raises(ValueError, match="hidden_act 'gelu'; supported: .*'gelu_pytorch_tanh'.*'silu'"):
        arch_from_dict({**BASE, "hidden_act": "gelu"})


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
def test_tp2_reads_each_ranks_rows_of_the_fused_tensors(model_factory, monkeypatch, kv_heads):
    """Each rank takes its heads of q, k and v and its rows of gate and up out of the fused
    tensors (ranks as threads, tests/engine/tp_threads)."""
    from engine import executor as executor_registry
    from tests.engine.tp_threads import ThreadExecutor

    model = model_factory("phi3", partial_rotary_factor=0.75, num_key_value_heads=kv_heads)
    prompts = random_prompts([3, 21, 40], 900, seed=7)
    expected = hf_greedy(model, prompts, MAX_NEW)
    monkeypatch.setitem(executor_registry.EXECUTORS.factories, "mp", ThreadExecutor)
    two = LLM(model, tensor_parallel_size=2, max_model_len=256, long_prefill_token_threshold=16)
    try:
        assert _generate(two, prompts) == expected
    finally:
        two.shutdown()
