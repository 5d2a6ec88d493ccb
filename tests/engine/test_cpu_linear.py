"""oneDNN-packed projections on CPU (engine.models.cpu_linear): same products as the dense
weights, packed once by the CPU model runner, off on request."""

from __future__ import annotations

import pytest
import torch

import kernels
from engine.models import cpu_linear
from engine.models.arch import load_arch
from engine.models.loader import load_model
from engine.models.parallel import ColumnParallelLinear

needs_onednn = pytest.mark.skipif(not cpu_linear.onednn_linear_available(), reason="no oneDNN in this torch")


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 7, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_projection_equals_the_dense_one(rows, bias):
    torch.manual_seed(0)
    layer = ColumnParallelLinear(48, 40, bias=bias)
    x = torch.randn(rows, 48)
    expected = layer(x)
    assert layer.pack() and layer.weight is None
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_packing_skips_what_onednn_does_not_run():
    assert not ColumnParallelLinear(16, 8, bias=False).to(torch.bfloat16).pack()
    assert cpu_linear.pack_weight(torch.randn(8, 16, dtype=torch.float16)) is None


def _load(model_dir):
    arch = load_arch(model_dir)
    return load_model(model_dir, arch, kernels.get_ops("torch", "cpu"), torch.device("cpu"), torch.float32, 64)


@needs_onednn
@pytest.mark.parametrize("tied", [False, True])
def test_packed_model_gives_the_dense_models_hidden_states_and_logits(model_factory, tied):
    model_dir = model_factory("llama", tie_word_embeddings=tied)
    dense, packed = _load(model_dir), _load(model_dir)
    layers = len(packed.layers)
    assert packed.pack_cpu_weights() == 4 * layers + 1  # qkv, o, gate_up, down per layer + the head
    assert packed.layers[0].mlp.gate_up_proj.weight is None
    hidden = torch.randn(5, packed.arch.hidden_size)
    torch.testing.assert_close(packed.compute_logits(hidden), dense.compute_logits(hidden), atol=1e-4, rtol=1e-4)


@needs_onednn
def test_cpu_runner_packs_unless_disabled(tiny_model, monkeypatch):
    from engine import LLM

    llm = LLM(tiny_model, num_kv_blocks=64)
    assert llm.engine.core.executor.worker.runner.model.layers[0].self_attn.qkv_proj.packed_weight is not None
    monkeypatch.setenv("PDSERVE_ONEDNN_LINEAR", "0")
    llm = LLM(tiny_model, num_kv_blocks=64)
    assert llm.engine.core.executor.worker.runner.model.layers[0].self_attn.qkv_proj.weight is not None
