"""Quantized Hugging Face checkpoints (GPTQ, AWQ, compressed-tensors): each method's tensors
unpack to the checkpoint's own dequantization (the libraries' dequantizers where they install,
AutoAWQ's and compressed-tensors'), repack into GGUF blocks bit for bit, load kept quantized
from the checkpoint's quantization_config alone, and give transformers' greedy tokens on the
same checkpoint dequantized in fp32; W8A8 within a near-tie of transformers running the
compressed-tensors checkpoint itself; unsupported configs are refused by name."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from engine.errors import ParameterError
from engine.models import fused_decode
from engine.models.gguf_quants import dequantize
from engine.models.half_linear import HalfWeight
from engine.models.hf_quant_config import hf_scheme
from engine.models.hf_quant_plan import HFQuantPlan
from engine.models.hf_quant_unpack import to_blocks
from engine.models.int8_linear import Int8Weight
from engine.models.quant_linear import QuantWeight
from tests.engine.hf_quant_factory import write_quantized
from tests.engine.hf_reference import hf_greedy, hf_mismatches, random_prompts

# 128/256-wide so group sizes 32, 64 and 128 all divide the rows.
SHAPE = dict(hidden_size=128, intermediate_size=256)
GREEDY = SamplingParams(temperature=0, max_tokens=10)
# In logits: W8A8 rounds activations to int8 per token; transformers (compressed-tensors'
# forward) rounds with a step of max|x| / 127.5 where we take vLLM's max|x| / 127, so top tokens
# this close may swap: measured 0.052 (1 of 30 positions), the same bound as int8 activations
# on GGUF weights (test_quantized_gguf.INT8_MARGIN). A wrong scale or row moves logits by whole
# units.
W8A8_MARGIN = 0.1
# name -> write_quantized arguments
CASES = {
    "gptq-4bit-sym-g128": dict(method="gptq", bits=4, group=128, sym=True),
    "gptq-4bit-asym-desc_act-g32": dict(method="gptq", bits=4, group=32, sym=False, desc_act=True),
    "gptq-8bit-sym-channel": dict(method="gptq", bits=8, group=-1, sym=True),
    "gptq_v2-4bit-asym-g64": dict(method="gptq", bits=4, group=64, sym=False, v2=True),
    "awq-g64": dict(method="awq", group=64, sym=False),
    "ct-w4a16-sym-g128": dict(method="ct", group=128, sym=True),
    "ct-w4a16-asym-g64": dict(method="ct", group=64, sym=False),
    "ct-w4a16-sym-desc_act-g32": dict(method="ct", group=32, sym=True, desc_act=True),
    "ct-w8a16-8bit-channel": dict(method="ct", bits=8, group=-1, sym=True, w8a8=False),
    "ct-w8a8-channel": dict(method="ct", bits=8, group=-1, sym=True),
}


@pytest.fixture(scope="module")
def checkpoints(model_factory, tmp_path_factory):
    src = model_factory("llama", **SHAPE)
    out = tmp_path_factory.mktemp("hf-quant")
    return {name: write_quantized(src, str(out / name), **kw) for name, kw in CASES.items()}


def _modules(path: str) -> dict[str, dict[str, torch.Tensor]]:
    tensors = load_file(os.path.join(path, "model.safetensors"))
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        module, _, part = name.rpartition(".")
        out.setdefault(module, {})[part] = t
    return out


def _plan(path: str) -> HFQuantPlan:
    return HFQuantPlan([os.path.join(path, "model.safetensors")], hf_scheme(path, None), keep=True)


@pytest.mark.parametrize("name", [n for n in CASES if "w8a8" not in n])
def test_repacked_blocks_decode_bit_for_bit_to_the_checkpoints_dequantization(checkpoints, name):
    quantized, oracle = checkpoints[name]
    plan, dense = _plan(quantized), load_file(os.path.join(oracle, "model.safetensors"))
    for module in plan.modules:
        w = plan.group_quant(module)
        assert torch.equal(w.dequantize(), dense[f"{module}.weight"]), module
        qtype, data, perm = to_blocks(w)
        n, k = w.q.shape
        blocks = dequantize(data.reshape(-1), qtype, (n, k))
        assert torch.equal(blocks, dense[f"{module}.weight"] if perm is None else dense[f"{module}.weight"][:, perm])
        assert qtype == ("Q8_0" if "8bit" in name else "Q4_0" if "-sym" in name else "Q5_0")
        assert (perm is not None) == ("desc_act" in name)


def test_weights_no_block_type_holds_exactly_are_not_repacked():
    from engine.models.hf_quant_unpack import GroupQuant

    g = torch.Generator().manual_seed(1)
    q, zeros = torch.randint(0, 16, (4, 64), generator=g, dtype=torch.int16), torch.full((4, 2), 8, dtype=torch.int16)
    scales = torch.rand(4, 2, generator=g).half()
    assert to_blocks(GroupQuant(q, zeros, scales, torch.arange(64) // 32))[0] == "Q4_0"
    assert to_blocks(GroupQuant(q, zeros, scales.float() + 1e-4, torch.arange(64) // 32)) is None  # not fp16
    assert to_blocks(GroupQuant(q, torch.full((4, 4), 8, dtype=torch.int16), torch.rand(4, 4).half(),
                                torch.arange(64) // 16)) is None  # groups of 16 cut a block
    wide = torch.randint(0, 256, (4, 64), generator=g, dtype=torch.int16)
    assert to_blocks(GroupQuant(wide, torch.zeros(4, 2, dtype=torch.int16), scales, torch.arange(64) // 32)) is None


def test_gptq_v1_reads_a_stored_zero_of_15_as_16_as_its_kernels_do():
    # auto-gptq's v1 packing stores zero - 1 in 4 bits, so a zero point of 0 wraps to 15 and its
    # kernels read back 15 + 1 = 16: the checkpoint's dequantization is scale * (q - 16).
    from engine.models.hf_quant_unpack import from_gptq

    g = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (64, 8), generator=g)  # [K, N]
    qweight = (q.view(8, 8, 8) << (4 * torch.arange(8))[None, :, None]).sum(dim=1)  # [K / 8, N]
    qweight = torch.where(qweight >= 2**31, qweight - 2**32, qweight).to(torch.int32)
    qzeros = torch.full((2, 1), -1, dtype=torch.int32)  # every nibble 15
    scales = torch.rand(2, 8, generator=g).half()
    w = from_gptq({"qweight": qweight, "qzeros": qzeros, "scales": scales}, 4, 1)
    ref = scales.float().repeat_interleave(32, 0).T * (q.T.float() - 16)
    assert torch.equal(w.dequantize(), ref)
    qtype, data, _ = to_blocks(w)
    assert qtype == "Q5_0" and torch.equal(dequantize(data.reshape(-1), qtype, (8, 64)), ref)


def test_awq_unpacks_as_autoawqs_own_dequantizer(checkpoints):
    from awq.utils.packing_utils import dequantize_gemm

    quantized, _ = checkpoints["awq-g64"]
    plan = _plan(quantized)
    for module, t in _modules(quantized).items():
        if "qweight" in t:
            ref = dequantize_gemm(t["qweight"], t["qzeros"], t["scales"].float(), 4, 64).T
            assert torch.equal(plan.group_quant(module).dequantize(), ref), module


def test_compressed_tensors_unpacks_as_its_own_decompressor(checkpoints):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    quantized, _ = checkpoints["ct-w4a16-asym-g64"]
    plan = _plan(quantized)
    for module, t in _modules(quantized).items():
        if "weight_packed" in t:
            shape = torch.Size(t["weight_shape"].tolist())
            q = unpack_from_int32(t["weight_packed"], 4, shape).float()
            zp = unpack_from_int32(t["weight_zero_point"], 4, torch.Size([shape[0], shape[1] // 64]), 0).float()
            ref = (q - zp.repeat_interleave(64, 1)) * t["weight_scale"].float().repeat_interleave(64, 1)
            assert torch.equal(plan.group_quant(module).dequantize(), ref), module


def _model(llm):
    return llm.engine.core.executor.worker.runner.model


def _tokens(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# One model per packing (GPTQ with act-order, AWQ, compressed-tensors); the other cases' weights
# reach the same kept blocks, checked bit for bit above.
@pytest.mark.parametrize("name", ["gptq-4bit-asym-desc_act-g32", "awq-g64", "ct-w4a16-sym-g128"])
def test_kept_quantized_from_the_config_alone_with_transformers_greedy_tokens(checkpoints, name):
    quantized, oracle = checkpoints[name]
    llm = LLM(quantized, max_model_len=128)
    kept = [m for m in _model(llm).modules() if getattr(m, "quant", None) is not None]
    assert len(kept) == 2 * 4 and all(m.weight is None and isinstance(m.quant, QuantWeight) for m in kept)
    # Without act-order the decode steps run as one C call, as a GGUF file's do.
    assert (fused_decode.why_not(_model(llm)) is None) == ("desc_act" not in name)
    prompts = random_prompts([4, 30, 61], 500, seed=3)
    # compressed-tensors loads in transformers itself (its own decompressor); GPTQ and AWQ need
    # GPU packages there, so their oracle is the dense checkpoint of the same weights.
    reference = quantized if name.startswith("ct-") else oracle
    assert _tokens(llm, prompts) == hf_greedy(reference, prompts, GREEDY.max_tokens)


# What real checkpoints store unquantized (fp16 or bf16 head, norms and embedding table), on a
# model with its own head, one with tied embeddings, and one whose head is quantized too
# (gptqmodel's lm_head: true); the oracle is the dense fp32 checkpoint of the same values.
@pytest.mark.parametrize("family, dtype, lm_head", [("llama", torch.float16, False), ("qwen2", torch.bfloat16, False),
                                                    ("llama", torch.float16, True)])
def test_unquantized_vocabulary_tensors_stay_16_bit_and_a_quantized_head_stays_blocks(
        model_factory, tmp_path, family, dtype, lm_head):
    quantized, oracle = write_quantized(model_factory(family, **SHAPE), str(tmp_path / "q"), "gptq", group=32,
                                        dense_dtype=dtype, lm_head=lm_head)
    llm = LLM(quantized, max_model_len=128)
    model = _model(llm)
    assert isinstance(model.embed_tokens.quant, HalfWeight) and model.embed_tokens.quant.weight.dtype == dtype
    if family == "qwen2":
        assert model.lm_head is None  # the logits read the 16-bit table
    else:
        assert isinstance(model.lm_head.quant, QuantWeight if lm_head else HalfWeight)
        assert model.lm_head.weight is None
    prompts = random_prompts([4, 30, 61], 500, seed=5)
    assert _tokens(llm, prompts) == hf_greedy(oracle, prompts, GREEDY.max_tokens)


def test_quantization_none_dequantizes_to_the_same_tokens(checkpoints):
    quantized, oracle = checkpoints["gptq-4bit-asym-desc_act-g32"]
    llm = LLM(quantized, max_model_len=128, quantization="none")
    assert not any(getattr(m, "quant", None) is not None for m in _model(llm).modules())
    prompts = random_prompts([4, 30], 500, seed=4)
    assert _tokens(llm, prompts) == hf_greedy(oracle, prompts, GREEDY.max_tokens)


def test_w8a8_keeps_int8_weights_within_a_near_tie_of_transformers(checkpoints, caplog):
    quantized, _ = checkpoints["ct-w8a8-channel"]
    with caplog.at_level(logging.INFO, logger="engine.models.loader"):
        llm = LLM(quantized, max_model_len=128)
    assert ("compressed-tensors weights: 14 of 14 quantized projections kept (int8 weights, int8 dynamic "
            "per-token activations)") in caplog.text
    kept = [m for m in _model(llm).modules() if getattr(m, "quant", None) is not None]
    assert len(kept) == 2 * 4 and all(isinstance(m.quant, Int8Weight) for m in kept)
    prompts = random_prompts([4, 30, 61], 500, seed=3)
    assert hf_mismatches(quantized, prompts, _tokens(llm, prompts), W8A8_MARGIN) == 0


def test_int8_product_is_the_rounded_activations_times_the_weight():
    g = torch.Generator().manual_seed(0)
    w, scale = torch.randint(-127, 128, (48, 64), generator=g, dtype=torch.int8), torch.rand(48, generator=g) + 0.5
    qw = Int8Weight(48, 64)
    qw.add(16, 48, w[16:], scale[16:])
    qw.add(0, 16, w[:16], scale[:16])
    x = torch.randn(5, 64, generator=g)
    step = x.abs().amax(dim=1, keepdim=True) / 127
    ref = (torch.round(x / step) * step).double() @ (w.double() * scale.double()[:, None]).T
    assert qw.covered() and torch.allclose(qw.matmul(x).double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(qw.dequantize(), w.float() * scale[:, None])


def _config_dir(tmp_path, qc: dict | None) -> str:
    cfg = {"architectures": ["LlamaForCausalLM"]}
    if qc is not None:
        cfg["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("qc, quantization, words", [
    ({"quant_method": "bitsandbytes"}, None, ["quant_method", "'gptq', 'awq', 'compressed-tensors'"]),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, None, ["bits", "(4, 8)"]),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, None, ["version", "gemm"]),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}, None, ["float", "FP8", "CPU"]),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "awq", ["'awq'", "'gptq'"]),
    (None, "gptq", ["quantization_config"]),
])
def test_unsupported_quantization_configs_are_refused_by_name(tmp_path, qc, quantization, words):
    with pytest.raises(ParameterError) as err:
        hf_scheme(_config_dir(tmp_path, qc), quantization)
    assert err.value.field == "quantization" and all(w in str(err.value) for w in words), str(err.value)


def test_an_unsupported_checkpoint_fails_at_load_naming_the_setting(checkpoints, tmp_path):
    quantized, _ = checkpoints["gptq-4bit-sym-g128"]
    for name in os.listdir(quantized):
        if name != "config.json":
            os.symlink(os.path.join(quantized, name), tmp_path / name)
    with open(os.path.join(quantized, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"]["bits"] = 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ParameterError, match="quantization_config.bits = 2"):
        LLM(str(tmp_path), max_model_len=128)


def test_tensor_parallel_ranks_keep_their_rows_and_dequantize_split_columns(checkpoints, monkeypatch):
    from engine import executor as executor_registry
    from tests.engine.tp_threads import ThreadExecutor

    quantized, oracle = checkpoints["gptq-4bit-asym-desc_act-g32"]
    monkeypatch.setitem(executor_registry.EXECUTORS.factories, "mp", ThreadExecutor)
    two = LLM(quantized, tensor_parallel_size=2, max_model_len=128)
    try:
        for worker in two.engine.core.executor.workers:
            kept = {n for n, m in worker.runner.model.named_modules() if getattr(m, "quant", None) is not None}
            # Column-parallel rows split whole; a row-parallel shard splits act-ordered columns.
            assert kept == {f"layers.{i}.{p}" for i in (0, 1) for p in ("self_attn.qkv_proj", "mlp.gate_up_proj")}
        prompts = random_prompts([5, 33], 500, seed=4)
        assert _tokens(two, prompts) == hf_greedy(oracle, prompts, GREEDY.max_tokens)
    finally:
        two.shutdown()


def test_an_autogptq_quantize_config_json_is_read_when_config_json_has_none(tmp_path):
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 8, "group_size": 128, "desc_act": True}))
    scheme = hf_scheme(_config_dir(tmp_path, None), None)
    assert (scheme.method, scheme.bits, scheme.zero_offset) == ("gptq", 8, 1)
