"""Mixture-of-experts models (Qwen3-MoE, Mixtral): config reading, expert stacking at load,
and greedy tokens equal to Hugging Face `generate` (docs/architecture.md#invariants)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open

import kernels
from engine import LLM, SamplingParams
from engine.errors import ParameterError
from engine.models import loader
from engine.models.arch import arch_from_dict, load_arch
from engine.models.parallel import check_tp_size
from tests.engine.hf_reference import hf_greedy, random_prompts

# Fewer and shorter than test_parity's: each MoE layer is a loop over experts on CPU.
LENGTHS = [3, 17, 40, 5, 33, 16]
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            vocab_size=128, num_experts_per_tok=2, moe_intermediate_size=32)

VARIANTS = {
    "qwen3_moe": ("qwen3_moe", {}),
    # Plain top-k weights (no renormalisation) and a dense MLP layer between sparse ones.
    "qwen3_moe-unnormalised-dense-layer": ("qwen3_moe", dict(norm_topk_prob=False, mlp_only_layers=[1])),
    "mixtral": ("mixtral", {}),
}


def _make(model_factory, variant):
    family, overrides = VARIANTS[variant]
    return model_factory(family, **overrides)


def _generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_qwen3_moe_sparse_layers_follow_sparse_step_and_mlp_only_layers():
    arch = arch_from_dict({**BASE, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8,
                           "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [arch.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert arch.qk_norm and arch.moe_intermediate_size == 32 and not arch.norm_topk_prob


def test_mixtral_experts_use_intermediate_size_and_always_renormalise():
    arch = arch_from_dict({**BASE, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
                           "norm_topk_prob": False})
    assert arch.num_experts == 4 and arch.moe_intermediate_size == 128 and arch.norm_topk_prob
    assert all(arch.is_moe_layer(i) for i in range(4)) and not arch.qk_norm


def test_tensor_parallel_must_divide_the_experts_intermediate_size():
    arch = arch_from_dict({**BASE, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
                           "moe_intermediate_size": 18})
    check_tp_size(arch, 2)  # heads (4), dense intermediate (128) and experts' (18) all split
    with pytest.raises(ParameterError, match="tensor_parallel_size=4.*experts' intermediate size 18"):
        check_tp_size(arch, 4)


@pytest.mark.parametrize("variant, names", [
    ("mixtral", ("block_sparse_moe", "w1", "w3", "w2")),
    ("qwen3_moe", ("mlp", "gate_proj", "up_proj", "down_proj")),
])
def test_per_expert_weights_are_stacked_into_w13_and_w2(model_factory, variant, names):
    model_dir = _make(model_factory, variant)
    arch = load_arch(model_dir)
    model = loader.load_model(model_dir, arch, kernels.get_ops("torch"), torch.device("cpu"),
                              torch.float32, 64)
    block, gate, up, down = names
    inter = arch.moe_intermediate_size
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        for layer, expert in ((0, 0), (1, 5), (1, 7)):
            key = f"model.layers.{layer}.{block}.experts.{expert}"
            moe = model.layers[layer].mlp
            assert torch.equal(moe.w13[expert, :inter], f.get_tensor(f"{key}.{gate}.weight"))
            assert torch.equal(moe.w13[expert, inter:], f.get_tensor(f"{key}.{up}.weight"))
            assert torch.equal(moe.w2[expert], f.get_tensor(f"{key}.{down}.weight"))
        assert torch.equal(model.layers[1].mlp.gate.weight, f.get_tensor(f"model.layers.1.{block}.gate.weight"))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_moe_greedy_matches_transformers_for_mixed_batch(model_factory, variant):
    model = _make(model_factory, variant)
    llm = LLM(model, max_model_len=256)
    prompts = random_prompts(LENGTHS, llm.engine.core.arch.vocab_size - 64)
    assert _generate(llm, prompts) == hf_greedy(model, prompts, MAX_NEW)


def test_moe_greedy_matches_transformers_with_forced_chunked_prefill(model_factory):
    model = _make(model_factory, "mixtral")
    llm = LLM(model, max_model_len=256, long_prefill_token_threshold=7, max_num_batched_tokens=24)
    prompts = random_prompts(LENGTHS, 1000, seed=1)
    assert _generate(llm, prompts) == hf_greedy(model, prompts, MAX_NEW)


def test_moe_greedy_matches_transformers_on_prefix_cache_hits(model_factory):
    model = _make(model_factory, "qwen3_moe")
    llm = LLM(model, max_model_len=256)
    shared = random_prompts([48], 1000, seed=3)[0]
    prompts = [shared + tail for tail in random_prompts([1, 9, 16, 30], 1000, seed=4)]
    first = _generate(llm, prompts)
    second = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= 48 for o in second)
    assert [o.outputs[0].token_ids for o in second] == first == hf_greedy(model, prompts, MAX_NEW)


def test_moe_greedy_matches_transformers_with_triton_kernels(model_factory):
    # The Triton fused_moe (and attention) under the interpreter, through the whole engine.
    model = _make(model_factory, "qwen3_moe")
    llm = LLM(model, max_model_len=64, kernel_backend="triton")
    assert llm.engine.core.kernel_backend == "triton"
    prompts = random_prompts([3, 11], llm.engine.core.arch.vocab_size - 64, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    got = [o.outputs[0].token_ids for o in
           llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert got == hf_greedy(model, prompts, 4)
