"""GGUF weights kept in their blocks (quantization="gguf", the default for a GGUF file): which
projections stay quantized, that no dense copy of them exists, and that greedy tokens equal
the dequantized path and transformers on the same file, also under TP=2."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ParameterError
from engine.models import quant_linear
from engine.models.quant_linear import QuantWeight
from tests.engine.gguf_factory import write_gguf
from tests.engine.hf_reference import hf_greedy, hf_mismatches, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12)
# In logits. The kernels quantize activations to int8 per block, as llama.cpp does, so top
# tokens closer than this may swap against transformers' fp32; measured up to 0.11 on the
# llama.cpp K-quant mixes of a 256-wide tiny model, whose logits spread ~1 per position. A
# wrong block, scale or row moves logits by whole units. The dense path stays exact.
INT8_MARGIN = 0.15
# 256-wide rows so the K-quants fit too; attn_v in Q6_K beside Q4_K q and k, as Q4_K_M mixes.
SHAPE = dict(hidden_size=256, intermediate_size=512)
MIX = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
       "ffn_up": "Q5_K", "ffn_down": "Q6_K", "token_embd": "Q8_0"}


@pytest.fixture(scope="module")
def files(model_factory, tmp_path_factory):
    out = tmp_path_factory.mktemp("quantized")
    hf = model_factory("llama", **SHAPE)
    return {
        "Q4_0": write_gguf(model_factory("llama"), str(out / "q4_0.gguf"), "Q4_0"),
        "Q4_1": write_gguf(model_factory("qwen2"), str(out / "q4_1.gguf"), "Q4_1", "qwen2"),
        "Q8_0": write_gguf(model_factory("llama"), str(out / "q8_0.gguf"), "Q8_0"),
        "mix": write_gguf(hf, str(out / "mix.gguf"), "Q4_K", types=MIX),
    }


def _tokens(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _model(llm):
    return llm.engine.core.executor.worker.runner.model


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "mix", "mix-int8"])
def test_quantized_path_equals_the_dequantized_path_and_transformers(files, name, monkeypatch):
    """Exact weights by default; with int8 activations (PDSERVE_QUANT_ACTIVATIONS=int8) within
    the near-tie margin."""
    from kernels.cpu import quant

    if name.endswith("-int8"):
        monkeypatch.setitem(quant.METHODS, "auto", quant.METHODS["int8"])
    path = files[name.removesuffix("-int8")]
    prompts = random_prompts([4, 30, 61], 900, seed=9)
    quantized = LLM(path, max_model_len=128, long_prefill_token_threshold=16)
    model = _model(quantized)
    kept = [m for m in model.modules() if getattr(m, "quant", None) is not None]
    assert kept and all(m.weight is None for m in kept)  # no dense copy of a kept projection
    dense = LLM(path, max_model_len=128, quantization="none")
    assert not any(getattr(m, "quant", None) is not None for m in _model(dense).modules())
    assert _tokens(dense, prompts) == hf_greedy(path, prompts, 12)
    got = _tokens(quantized, prompts)
    assert hf_mismatches(path, prompts, got, INT8_MARGIN) == 0


def test_a_fused_projection_of_mixed_types_is_kept_in_segments(files):
    model = _model(LLM(files["mix"], max_model_len=128))
    attn = model.layers[0].self_attn.qkv_proj.quant
    assert isinstance(attn, QuantWeight) and attn.covered()
    assert [s.qtype for s in attn.segments] == ["Q4_K", "Q4_K", "Q6_K"]
    assert [s.qtype for s in model.layers[0].mlp.gate_up_proj.quant.segments] == ["Q4_K", "Q5_K"]
    assert model.embed_tokens.quant.segments[0].qtype == "Q8_0"
    assert model.lm_head.quant.segments[0].qtype == "Q4_K"
    # A tied head reads the embedding's blocks: no packed or dense copy of the table.
    tied = _model(LLM(files["Q4_1"], max_model_len=128))
    assert tied.lm_head is None and tied.tied_head is None and tied.embed_tokens.quant is not None


def test_kept_blocks_decode_to_what_the_dequantized_path_loads(files):
    kept = _model(LLM(files["mix"], max_model_len=128))
    dense = _model(LLM(files["mix"], max_model_len=128, quantization="none", kernel_backend="torch"))
    w = kept.layers[1].self_attn.qkv_proj.quant.dequantize()
    ref = dense.layers[1].self_attn.qkv_proj
    ref_w = ref.weight if ref.weight is not None else None
    if ref_w is None:  # oneDNN packed it: multiply the identity instead
        ref_w = ref.linear(torch.eye(ref.in_features)).T
    assert torch.allclose(w, ref_w, atol=1e-6)


@pytest.mark.gpu
def test_kept_blocks_on_the_sessions_device_decode_as_the_dequantized_load(files, device, monkeypatch):
    """On CUDA the projections stay blocks through the Triton kernel (opted in here), on CPU
    through the C kernels; in fp32 both multiply the exact weights, so the tokens equal the
    dequantized load's on the same device."""
    monkeypatch.setattr(quant_linear, "TRITON_GGUF", True)
    prompts = random_prompts([4, 30, 61], 900, seed=11)
    kept = LLM(files["mix"], max_model_len=128, dtype="float32", device=device)
    model = _model(kept)
    assert model.layers[0].mlp.gate_up_proj.quant is not None
    assert all(s.data.device.type == device for s in model.layers[0].self_attn.qkv_proj.quant.segments)
    dense = LLM(files["mix"], max_model_len=128, dtype="float32", quantization="none", device=device)
    assert _tokens(kept, prompts) == _tokens(dense, prompts)


def test_tensor_parallel_ranks_keep_their_rows_and_block_columns(files, monkeypatch):
    from engine import executor as executor_registry
    from tests.engine.tp_threads import ThreadExecutor

    prompts = random_prompts([5, 33], 900, seed=4)
    monkeypatch.setitem(executor_registry._EXECUTORS, "mp", ThreadExecutor)
    two = LLM(files["mix"], tensor_parallel_size=2, max_model_len=128)
    try:
        for worker in two.engine.core.executor.workers:
            kept = {n for n, m in worker.runner.model.named_modules() if getattr(m, "quant", None) is not None}
            # Rows split whole; o_proj's 128 input columns per rank cut Q4_K's 256-value blocks.
            assert "layers.0.self_attn.qkv_proj" in kept and "layers.0.self_attn.o_proj" not in kept
        assert hf_mismatches(files["mix"], prompts, _tokens(two, prompts), INT8_MARGIN) == 0
    finally:
        two.shutdown()


def test_quantization_must_be_a_known_method(files):
    with pytest.raises(ParameterError, match="quantization"):
        LLM(files["Q4_0"], quantization="awq")
