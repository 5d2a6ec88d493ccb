"""Loading Hugging Face checkpoints: architectures, config dialects, weights, dtypes."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core import resolve_max_model_len
from engine.llm_engine import eos_token_ids, load_tokenizer
from engine.models.arch import arch_from_dict, load_arch
from engine.models.rotary import inverse_frequencies

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=128)


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        arch_from_dict({**BASE, "architectures": ["GPT2LMHeadModel"]})


def test_legacy_rope_scaling_dialect_is_read():
    arch = arch_from_dict({**BASE, "architectures": ["LlamaForCausalLM"], "rope_theta": 500000.0,
                           "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192}})
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling_dict["rope_type"] == "llama3" and arch.rope_scaling_dict["factor"] == 8.0


def test_unsupported_rope_type_is_rejected():
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        arch_from_dict({**BASE, "architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn"}})


def test_family_flags():
    q2 = arch_from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    q3 = arch_from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert q2.qkv_bias and not q2.o_bias and not q2.qk_norm
    assert q3.qk_norm and q3.head_dim == 32 and not q3.qkv_bias
    assert arch_from_dict({**BASE, "architectures": ["LlamaForCausalLM"]}).num_kv_heads == 4


def test_llama3_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    cfg = LlamaConfig(**BASE, rope_parameters={**scaling, "rope_theta": 10000.0})
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = inverse_frequencies(16, 10000.0, scaling)
    assert torch.allclose(ours, theirs, rtol=1e-6)
    assert not torch.allclose(ours, inverse_frequencies(16, 10000.0, None))


def test_sliding_window_configs_give_each_layer_its_window():
    """Sliding windows are attention masks now, not a cap on the context: each family's
    config dialect gives each layer its window."""
    mistral = arch_from_dict({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 256,
                              "max_position_embeddings": 4096})
    assert resolve_max_model_len(None, mistral) == 4096
    assert mistral.layer_windows == (256, 256)
    qwen = dict(BASE, architectures=["Qwen2ForCausalLM"], sliding_window=64, num_hidden_layers=4)
    assert arch_from_dict(qwen).layer_windows == ()  # use_sliding_window off
    assert arch_from_dict({**qwen, "use_sliding_window": True, "max_window_layers": 3}).layer_windows == (0, 0, 0, 64)
    gemma2 = dict(BASE, architectures=["Gemma2ForCausalLM"], sliding_window=8, num_hidden_layers=4)
    assert arch_from_dict(gemma2).layer_windows == (8, 0, 8, 0)
    gemma3 = dict(BASE, architectures=["Gemma3ForCausalLM"], sliding_window=8, num_hidden_layers=7)
    assert arch_from_dict(gemma3).layer_windows == (8, 8, 8, 8, 8, 0, 8)
    assert arch_from_dict({**gemma3, "sliding_window_pattern": 2}).layer_windows == (8, 0, 8, 0, 8, 0, 8)
    typed = {**gemma3, "layer_types": ["full_attention"] * 6 + ["sliding_attention"]}
    assert arch_from_dict(typed).layer_windows == (0,) * 6 + (8,)
    with pytest.raises(ValueError, match="layer_types has 2 entries for 7 layers"):
        arch_from_dict({**gemma3, "layer_types": ["full_attention"] * 2})


def test_gemma3_rope_dialects_give_global_and_local_bases():
    legacy = arch_from_dict({**BASE, "architectures": ["Gemma3ForCausalLM"], "rope_theta": 1e6,
                             "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    new = arch_from_dict({**BASE, "architectures": ["Gemma3ForCausalLM"], "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    for arch in (legacy, new):
        assert (arch.rope_theta, arch.local_rope_theta) == (1e6, 1e4)
        assert arch.rope_scaling_dict == {"rope_type": "linear", "factor": 8.0}
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        arch_from_dict({**BASE, "architectures": ["Gemma2ForCausalLM"], "hidden_activation": "gelu"})


def test_max_model_len_beyond_model_is_rejected(tiny_model):
    with pytest.raises(ValueError, match="max_model_len must be <= 1024"):
        LLM(tiny_model, max_model_len=5000)


def test_kv_cache_too_small_for_one_request_is_rejected(tiny_model):
    with pytest.raises(ValueError, match="num_kv_blocks"):
        LLM(tiny_model, max_model_len=256, num_kv_blocks=4)


def test_missing_weight_is_reported(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny_model, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing weights"):
        LLM(str(bad), max_model_len=64)


def test_wrong_weight_shape_is_reported(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny_model, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight"):
        LLM(str(bad), max_model_len=64)


def test_missing_model_directory_is_reported(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_prefill_logits_match_transformers(model_factory):
    from transformers import AutoModelForCausalLM

    model = model_factory("qwen2")
    llm = LLM(model, max_model_len=128)
    ids = list(range(10, 40))
    runner = llm.engine.core.executor.worker.runner
    captured = {}
    original = runner.model.compute_logits
    runner.model.compute_logits = lambda h: captured.setdefault("logits", original(h))
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(captured["logits"][0], theirs, atol=1e-4)


def test_bfloat16_weights_load_and_generate(tiny_model):
    llm = LLM(tiny_model, dtype="bfloat16", max_model_len=64)
    assert llm.engine.core.executor.worker.runner.model.embed_tokens.weight.dtype == torch.bfloat16
    out = llm.generate(["hello"], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5


def test_eos_ids_come_from_generation_config(tiny_model):
    tok = load_tokenizer(tiny_model)
    with open(os.path.join(tiny_model, "generation_config.json")) as f:
        expected = json.load(f)["eos_token_id"]
    assert eos_token_ids(tiny_model, tok) == expected
    assert tok.convert_tokens_to_ids("<|im_end|>") in expected


def test_made_model_has_chat_template_and_loads_in_transformers(tiny_model):
    tok = load_tokenizer(tiny_model)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert load_arch(tiny_model).vocab_size % 64 == 0 and load_arch(tiny_model).vocab_size >= len(tok)


def test_kv_budget_is_a_per_engine_share_of_the_device_that_must_fit_what_is_free():
    from engine.worker.worker import kv_budget_bytes

    GiB = 2**30
    # 80 GiB device; 5 GiB held by another process; ours: 2 GiB reserved, 1.5 GiB allocated
    # (weights), a forward pass peaked at 3 GiB. Our share is 0.9 * 80 = 72 GiB, whatever the
    # other process holds; the KV gets the share less our peak (it fits the 73.5 GiB free).
    assert kv_budget_bytes(80 * GiB, 73 * GiB, 2 * GiB, int(1.5 * GiB), 3 * GiB, 0.9) == int(72 * GiB - 3 * GiB)
    # Two engines on one card at 0.45 each (vLLM's usage): the second sees the first's 36 GiB
    # as taken, and still gets its own 36 GiB less its peak.
    assert kv_budget_bytes(80 * GiB, 42 * GiB, 2 * GiB, 1 * GiB, 3 * GiB, 0.45) == int(36 * GiB - 3 * GiB)
    # The same engine in the process that runs the first (the benchmark's offline engine
    # beside a server's): what the process held before this worker counts as the other's.
    assert kv_budget_bytes(80 * GiB, 42 * GiB, 38 * GiB, 37 * GiB, 39 * GiB, 0.45, 36 * GiB, 36 * GiB) \
        == int(36 * GiB - 3 * GiB)
    # The KV must leave the forward pass its room: another process holds 40 GiB; ours holds
    # 1 GiB of weights in a 3 GiB pool after a 3 GiB peak, so 36.5 GiB are free and a KV cache
    # plus a forward pass can take 36.5 + 3 - 3 = 36.5 GiB. At 0.5 the share asks 40 - 3 = 37.
    with pytest.raises(ValueError, match=r"only 36.5 GiB are free for its 37.0 GiB KV cache"):
        kv_budget_bytes(80 * GiB, int(36.5 * GiB), 3 * GiB, 1 * GiB, 3 * GiB, 0.5)
    assert kv_budget_bytes(80 * GiB, int(36.5 * GiB), 3 * GiB, 1 * GiB, 3 * GiB, 0.49) == int(0.49 * 80 * GiB - 3 * GiB)
    with pytest.raises(ValueError, match=r"peaks at 3.0 GiB of the 2.4 GiB it may use"):
        kv_budget_bytes(80 * GiB, 68 * GiB, 2 * GiB, 1 * GiB, 3 * GiB, 0.03)
    # Shares that sum past the card: refused with the figures, not an out-of-memory later.
    with pytest.raises(ValueError, match=r"only 10.0 GiB are free for its 33.0 GiB KV cache \(others on the GPU "
                                         r"use 67.0 GiB\)"):
        kv_budget_bytes(80 * GiB, 10 * GiB, 3 * GiB, 2 * GiB, 3 * GiB, 0.45)


def test_profile_run_executes_a_full_budget_forward(tiny_model):
    llm = LLM(tiny_model, max_model_len=128, max_num_batched_tokens=300)
    llm.engine.core.executor.worker.runner.profile_run(300)  # must not touch the real KV cache
    out = llm.generate(["hi"], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2
