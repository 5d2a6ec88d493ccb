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
@pytest.mark.parametrize("rows", [0, 1, 7, 16, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_projection_equals_the_dense_one(rows, bias):
    torch.manual_seed(0)
    layer = ColumnParallelLinear(48, 40, bias=bias)
    x = torch.randn(rows, 48)
    expected = layer(x)
    assert layer.pack() and layer.weight is None
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_row_buckets_bound_the_shapes_and_the_padding():
    sizes = [cpu_linear.row_bucket(rows) for rows in range(0, 4097)]
    assert sizes[:17] == list(range(17))  # decode-sized steps run at their own shape
    for rows, size in enumerate(sizes):
        assert rows <= size <= rows * 1.125, rows  # at most 12.5% padding
        assert cpu_linear.row_bucket(size) == size  # a bucket is its own bucket
    assert sizes == sorted(sizes)
    # 16 exact sizes, then 8 per doubling: 17..4096 is 8 doublings.
    assert len(set(sizes[1:])) == 16 + 8 * 8


@needs_onednn
def test_onednn_sees_only_bucketed_row_counts_and_rows_come_back_unpadded(monkeypatch):
    torch.manual_seed(0)
    layer = ColumnParallelLinear(24, 40, bias=True)
    dense = layer.weight.detach().clone()
    assert layer.pack()
    seen = []
    real = cpu_linear._onednn_linear

    def spy(x, packed, bias):
        seen.append(x.shape[0])
        return real(x, packed, bias)

    monkeypatch.setattr(cpu_linear, "_onednn_linear", spy)
    for rows in range(1, 300):
        x = torch.randn(rows, 24)
        out = layer(x)
        assert out.shape == (rows, 40)
        torch.testing.assert_close(out, x @ dense.T + layer.bias, atol=1e-5, rtol=1e-5)
    assert len(seen) == 299 and set(seen) <= {cpu_linear.row_bucket(rows) for rows in range(1, 300)}
    assert len(set(seen)) == 16 + 8 * 4 + 2  # 1..16, four doublings to 256, then 288 and 320
    # Leading dimensions are flattened for the bucket and restored after.
    x = torch.randn(3, 7, 24)
    torch.testing.assert_close(layer(x), x @ dense.T + layer.bias, atol=1e-5, rtol=1e-5)
    assert seen[-1] == cpu_linear.row_bucket(21) == 22


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
