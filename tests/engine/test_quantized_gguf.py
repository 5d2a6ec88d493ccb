"""GGUF weights kept in their blocks (quantization="gguf", the default for a GGUF file): which
projections stay quantized, that no dense copy of them exists, that greedy tokens equal the
dequantized path's and transformers' on the same file and logprobs the dequantized path's, also
under TP=2, and that int8 activations keep the tokens within a near-tie of transformers'."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ParameterError
from engine.models import quant_linear
from engine.models.quant_linear import QuantWeight
from kernels.cpu.build import level_in_use
from tests.engine.gguf_factory import write_gguf
from tests.engine.hf_reference import hf_greedy, hf_mismatches, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12)
# The default kept path multiplies the exact weights in fp32 (kernels.cpu.quant's "auto"), so
# it differs from the dequantized path only in the order of its sums: the same greedy tokens
# (transformers' too), and logprobs within this. Not bit for bit: measured up to 1.8e-5 (this
# module's K-quant mix; 2e-6 for the 32-value types; 1e-5 on llama.cpp's mixes) on an AVX-512
# EPYC. A wrong block, scale or row moves logits by whole units.
KEPT_LOGPROB_TOL = 1e-4
# In logits: with int8 activations (PDSERVE_QUANT_ACTIVATIONS=int8, llama.cpp's scheme), top
# tokens closer than this may swap against transformers' fp32. Measured 0.045 on this module's
# mix (3 of 36 positions), and up to 0.114 on test_gguf_llama_cpp.py's mixes (not run int8
# there), whose 256-wide tiny models spread their logits ~1 per position.
INT8_MARGIN = 0.1
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


def assert_kept_equals_dequantized(kept, dense, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy runs of two engines on one file, its blocks kept and dequantized: the same
    tokens, and each token's logprob within KEPT_LOGPROB_TOL. Returns the tokens."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1)
    runs = [[o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
            for llm in (kept, dense)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    for a, b in zip(*runs):
        for step, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) <= KEPT_LOGPROB_TOL for t in x), (step, x, y)
    return [o.token_ids for o in runs[0]]


def _kept_and_dense(path):
    quantized = LLM(path, max_model_len=128, long_prefill_token_threshold=16)
    kept = [m for m in _model(quantized).modules() if getattr(m, "quant", None) is not None]
    assert kept and all(m.weight is None for m in kept)  # no dense copy of a kept projection
    dense = LLM(path, max_model_len=128, quantization="none")
    assert not any(getattr(m, "quant", None) is not None for m in _model(dense).modules())
    return quantized, dense


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "mix"])
def test_kept_blocks_give_the_dequantized_paths_tokens_and_logprobs_and_transformers_tokens(files, name):
    path = files[name]
    prompts = random_prompts([4, 30, 61], 900, seed=9)
    quantized, dense = _kept_and_dense(path)
    assert assert_kept_equals_dequantized(quantized, dense, prompts, 12) == hf_greedy(path, prompts, 12)


def test_int8_activations_keep_greedy_tokens_within_a_near_tie_of_transformers(files, monkeypatch):
    from kernels.cpu import quant

    monkeypatch.setitem(quant.METHODS, "auto", quant.METHODS["int8"])
    path = files["mix"]
    prompts = random_prompts([4, 30, 61], 900, seed=9)
    quantized, dense = _kept_and_dense(path)
    assert _tokens(dense, prompts) == hf_greedy(path, prompts, 12)
    assert hf_mismatches(path, prompts, _tokens(quantized, prompts), INT8_MARGIN) == 0


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


def test_tensor_parallel_ranks_keep_their_rows_and_block_columns_and_give_transformers_tokens(files, monkeypatch):
    from engine import executor as executor_registry
    from tests.engine.tp_threads import ThreadExecutor

    prompts = random_prompts([5, 33], 900, seed=4)
    monkeypatch.setitem(executor_registry.EXECUTORS.factories, "mp", ThreadExecutor)
    two = LLM(files["mix"], tensor_parallel_size=2, max_model_len=128)
    try:
        for worker in two.engine.core.executor.workers:
            kept = {n for n, m in worker.runner.model.named_modules() if getattr(m, "quant", None) is not None}
            # Rows split whole; o_proj's 128 input columns per rank cut Q4_K's 256-value blocks.
            assert "layers.0.self_attn.qkv_proj" in kept and "layers.0.self_attn.o_proj" not in kept
        dense = LLM(files["mix"], max_model_len=128, quantization="none")
        assert assert_kept_equals_dequantized(two, dense, prompts, 12) == hf_greedy(files["mix"], prompts, 12)
    finally:
        two.shutdown()


def _load_log(caplog, path, **kw) -> tuple[LLM, str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.models.loader"):
        llm = LLM(path, max_model_len=128, device="cpu", **kw)
    return llm, caplog.text


def _kept(llm) -> bool:
    return any(getattr(m, "quant", None) is not None for m in _model(llm).modules())


def test_the_load_log_names_how_gguf_weights_are_held_and_why(files, caplog):
    llm, log = _load_log(caplog, files["Q4_0"])
    level = level_in_use()
    assert _kept(llm) == (level not in quant_linear.DEQUANTIZE_LEVELS)
    if _kept(llm):
        assert f"keep their quantized blocks, exact fp32 products (the default at the {level} ISA level;" in log
    _, log = _load_log(caplog, files["Q4_0"], quantization="none")
    assert "GGUF weights: dequantized to fp32 at load (quantization=none)" in log
    assert "keep their quantized blocks" not in log


def test_the_portable_level_dequantizes_by_default_unless_gguf_is_asked_for(files, caplog, monkeypatch):
    monkeypatch.setattr("kernels.cpu.build.level_in_use", lambda: "portable")
    llm, log = _load_log(caplog, files["Q4_0"])
    assert not _kept(llm) and "dequantized to fp32 at load (the default at the portable ISA level" in log
    llm, log = _load_log(caplog, files["Q4_0"], quantization="gguf")
    assert _kept(llm) and "exact fp32 products (quantization=gguf;" in log


def test_the_portable_default_keeps_blocks_whose_dense_copy_would_not_fit(monkeypatch):
    monkeypatch.setattr("kernels.cpu.build.level_in_use", lambda: "portable")
    monkeypatch.setattr(quant_linear, "free_memory_bytes", lambda: 3 * 2**30)
    cpu = torch.device("cpu")
    assert quant_linear.weights_choice(cpu, None, 2**30)[0] is False  # 1 GiB fits in half of 3
    keep, why = quant_linear.weights_choice(cpu, None, 2 * 2**30)
    assert keep and "2.0 GiB of fp32 weights is over half the free 3.0 GiB" in why


def test_int8_activations_are_named_as_the_choice_only_when_asked_for(monkeypatch):
    from kernels.cpu import quant

    cpu = torch.device("cpu")
    assert quant_linear.weights_choice(cpu, None, 0)[1].startswith("exact fp32 products")  # parity kept
    monkeypatch.setitem(quant.METHODS, "auto", quant.METHODS["int8"])  # as PDSERVE_QUANT_ACTIVATIONS=int8
    monkeypatch.setattr("kernels.cpu.build.level_in_use", lambda: "portable")
    assert quant_linear.weights_choice(cpu, None, 0) == (True, quant_linear.weights_choice(cpu, "gguf", 0)[1])
    assert quant_linear.weights_choice(cpu, None, 0)[1].startswith("int8 activations")


def test_quantization_must_be_a_known_method(files):
    with pytest.raises(ParameterError, match="quantization"):
        LLM(files["Q4_0"], quantization="awq")
