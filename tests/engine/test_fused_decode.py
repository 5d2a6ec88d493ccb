"""Short-query steps as one C call (engine.models.fused_decode, kernels.cpu.decode_stack): the
same hidden states bit for bit as the layer-by-layer path, so the same tokens and logprobs;
used where it applies and nowhere else."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models import fused_decode
from kernels.cpu.decode_stack import DecodeStack
from tests.engine.gguf_factory import write_gguf
from tests.engine.hf_reference import random_prompts

SHAPE = dict(hidden_size=256, intermediate_size=512)
# Q4_K_M-like: q and k in Q4_K, v in Q6_K, so the fused qkv projection is three segments.
MIX = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
       "ffn_up": "Q5_K", "ffn_down": "Q6_K", "token_embd": "Q8_0"}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def files(model_factory, tmp_path_factory):
    out = tmp_path_factory.mktemp("fused")
    return {
        "Q4_0": write_gguf(model_factory("llama"), str(out / "q4_0.gguf"), "Q4_0"),
        "mix": write_gguf(model_factory("llama", **SHAPE), str(out / "mix.gguf"), "Q4_K", types=MIX),
        "qwen2": write_gguf(model_factory("qwen2"), str(out / "qwen2.gguf"), "Q4_1", "qwen2"),
    }


def _model(llm):
    return llm.engine.core.executor.worker.runner.model


def _run(path, prompts, params, monkeypatch, fused: bool, **kwargs):
    monkeypatch.setenv(fused_decode.ENV, "1" if fused else "0")
    llm = LLM(path, max_model_len=256, long_prefill_token_threshold=16, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return _model(llm), [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("name, method, spec", [("Q4_0", "fp32", None), ("mix", "fp32", None),
                                                ("mix", "int8", None), ("Q4_0", "fp32", NGRAM)])
def test_the_stack_gives_the_layer_path_tokens_and_logprobs_exactly(files, name, method, spec, monkeypatch):
    from kernels.cpu import quant

    monkeypatch.setitem(quant.METHODS, "auto", quant.METHODS[method])
    # Three rows decoding together; chunked prompts (16-token chunks) take the layer path
    # while another row decodes, so both paths write the KV the other reads.
    prompts = random_prompts([5, 40, 23], 900, seed=3)
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=5, ignore_eos=True)
    kwargs = {"speculative_config": spec} if spec else {}
    fused_model, fused = _run(files[name], prompts, params, monkeypatch, True, **kwargs)
    layered_model, layered = _run(files[name], prompts, params, monkeypatch, False, **kwargs)
    assert isinstance(fused_model._stack, DecodeStack) and layered_model._stack is False
    assert fused == layered  # token ids and every logprob, bit for bit


def test_models_it_does_not_fit_keep_the_layer_path(files, tiny_model, monkeypatch):
    monkeypatch.delenv(fused_decode.ENV, raising=False)
    qwen2 = _model(LLM(files["qwen2"], max_model_len=64))
    assert fused_decode.why_not(qwen2) == "not a plain Llama layer"  # q/k/v biases
    dense = _model(LLM(tiny_model, max_model_len=64))
    assert "GGUF blocks" in fused_decode.why_not(dense)
    kept = _model(LLM(files["Q4_0"], max_model_len=64))
    assert fused_decode.why_not(kept) is None
    kept.layers[1].mlp.down_proj.lora = object()  # any adapter stack on a projection
    assert "LoRA" in fused_decode.why_not(kept)
    kept.layers[1].mlp.down_proj.lora = None
    monkeypatch.setenv(fused_decode.ENV, "0")
    assert fused_decode.why_not(kept) == f"{fused_decode.ENV}=0"


def test_bad_inputs_are_refused_by_name(files, monkeypatch):
    monkeypatch.delenv(fused_decode.ENV, raising=False)
    model = _model(LLM(files["Q4_0"], max_model_len=64))
    stack = fused_decode.build(model)
    hidden = model.arch.hidden_size
    hkv, d = model.layers[0].self_attn.hkv, model.layers[0].self_attn.d
    caches = [(torch.zeros(4, 16, hkv, d), torch.zeros(4, 16, hkv, d))] * len(model.layers)
    wrong = [(torch.zeros(4, 16, hkv, d + 8), torch.zeros(4, 16, hkv, d + 8))] * len(model.layers)
    i32 = torch.zeros(1, dtype=torch.int32)
    ok = dict(positions=torch.zeros(1, dtype=torch.int64), slot_mapping=torch.zeros(1, dtype=torch.int64),
              block_table=torch.zeros(1, 4, dtype=torch.int32), query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
              seq_lens=i32 + 1)
    with pytest.raises(ValueError, match="x fp32"):
        stack(torch.zeros(1, hidden, dtype=torch.float64), kv_caches=caches, **ok)
    with pytest.raises(ValueError, match="positions"):
        stack(torch.zeros(1, hidden), kv_caches=caches, **{**ok, "positions": i32})
    with pytest.raises(ValueError, match="kv caches for"):
        stack(torch.zeros(1, hidden), kv_caches=caches[:1], **ok)
    with pytest.raises(ValueError, match="kv caches must be fp32"):
        stack(torch.zeros(1, hidden), kv_caches=wrong, **ok)
    out = stack(torch.zeros(1, hidden), kv_caches=caches, **ok)  # and right ones run
    assert out.shape == (1, hidden) and torch.isfinite(out).all()
