"""Triton kernels against their torch references: under TRITON_INTERPRET=1 on CPU, compiled
on CUDA in a GPU session (the `gpu` marker, the `device` fixture: tests/conftest.py).

Grids are kept small: the interpreter runs every program instance in numpy. Inputs are made
on the CPU from seeded generators and moved, so both devices check the same values.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import reference as ref
from kernels import triton_kernels as tk
from tests.kernels.test_reference import _paged_inputs, one_token_per_page

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _close(a, b, dtype):
    assert a.dtype == b.dtype == dtype
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_matches_reference_with_padding_slots(dtype, device):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, (4 + 2 * 2) * 16, generator=g).to(device, dtype)
    # Strided views, as the fused qkv projection produces them.
    _, k, v = qkv.split([64, 32, 32], dim=-1)
    k, v = k.view(7, 2, 16), v.view(7, 2, 16)
    slots = torch.tensor([3, -1, 17, 0, -1, 31, 8], device=device)
    caches = [torch.zeros(4, 8, 2, 16, dtype=dtype, device=device) for _ in range(4)]
    ref.reshape_and_cache(k, v, caches[0], caches[1], slots)
    tk.reshape_and_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert int((caches[2] != 0).any(-1).any(-1).sum()) == 5  # the two -1 tokens wrote nothing


@pytest.mark.gpu
def test_reshape_and_cache_with_three_kv_heads(device):
    k, v = torch.randn(4, 3, 16).to(device), torch.randn(4, 3, 16).to(device)
    slots = torch.tensor([0, 5, -1, 9], device=device)
    caches = [torch.zeros(3, 4, 3, 16, device=device) for _ in range(4)]
    ref.reshape_and_cache(k, v, caches[0], caches[1], slots)
    tk.reshape_and_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, with_residual, device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 96, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(device, dtype)
    res = torch.randn(5, 96, generator=g).to(device, dtype) if with_residual else None
    a = ref.rms_norm(x, w, 1e-6, res)
    b = tk.rms_norm(x, w, 1e-6, res)
    if with_residual:
        _close(a[0], b[0], dtype)
        _close(a[1], b[1], dtype)  # the interpreter rounds fp32->bf16 by truncation
    else:
        _close(a, b, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [32, 16])  # full and partial rotary
def test_rotary_matches_reference(dtype, is_neox, rot_dim, device):
    from engine.models.rotary import cos_sin_cache

    g = torch.Generator().manual_seed(2)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    cache = cos_sin_cache(rot_dim, 64, 10000.0, scaling).to(device)
    qkv = torch.randn(6, (4 + 2 * 2) * 32, generator=g).to(device, dtype)
    q, k, _ = qkv.split([128, 64, 64], dim=-1)
    q, k = q.view(6, 4, 32), k.view(6, 2, 32)
    pos = torch.tensor([0, 5, 63, 17, 1, 40], device=device)
    a = ref.rotary_embedding(pos, q, k, cache, is_neox)
    b = tk.rotary_embedding(pos, q, k, cache, is_neox)
    _close(a[0], b[0], dtype)
    _close(a[1], b[1], dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype, device):
    x = torch.randn(3, 2, 80, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    _close(ref.silu_and_mul(x), tk.silu_and_mul(x), dtype)


def _attention_case(q_lens, ctx_lens, H, Hkv, D, page, dtype, device, seed=0):
    num_blocks = sum(-(-c // page) for c in ctx_lens) + 3
    q, kc, vc, table, qsl, seq_lens, _ = _paged_inputs(q_lens, ctx_lens, H, Hkv, D, page, num_blocks, seed)
    return (q.to(device, dtype), kc.to(device, dtype), vc.to(device, dtype), table.to(device), qsl.to(device),
            seq_lens.to(device))


def _check_attention(case, dtype, **kw):
    q, kc, vc, table, qsl, seq_lens = case
    scale = 1 / math.sqrt(q.shape[-1])
    expected = ref.paged_attention(q.float(), kc.float(), vc.float(), table, qsl, seq_lens, scale)
    got = tk.paged_attention(q, kc, vc, table, qsl, seq_lens, scale, **kw)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=5 * TOL[dtype], rtol=5 * TOL[dtype])


# Mixed: a prefill chunk over a cached prefix, decodes, a full prefill; contexts not
# multiples of the page size.
MIXED = ([5, 1, 1, 9, 1], [21, 17, 3, 9, 34])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H, Hkv", [(4, 4), (8, 2), (4, 1), (6, 2)])
def test_paged_attention_mixed_batch_matches_reference(dtype, H, Hkv, device):
    _check_attention(_attention_case(*MIXED, H, Hkv, 32, 16, dtype, device), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
def test_paged_attention_head_dims(D, device):
    _check_attention(_attention_case([3, 1], [19, 40], 4, 2, D, 16, torch.float32, device, seed=1), torch.float32)


@pytest.mark.gpu
def test_paged_attention_is_page_size_invariant(device):
    q_lens, ctx_lens = [4, 1, 1], [20, 35, 7]
    q, kc, vc, table, qsl, seq_lens, dense = _paged_inputs(q_lens, ctx_lens, 4, 2, 32, 16, 8, seed=2)
    q, kc, vc, table, qsl, seq_lens = (t.to(device) for t in (q, kc, vc, table, qsl, seq_lens))
    out16 = tk.paged_attention(q, kc, vc, table, qsl, seq_lens, 0.2)
    out1 = tk.paged_attention(q, *(t.to(device) for t in one_token_per_page(dense, ctx_lens)), qsl, seq_lens, 0.2)
    torch.testing.assert_close(out16, out1, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_split_kv_decode(splits, dtype, device):
    case = _attention_case([1, 1, 1], [70, 5, 33], 8, 2, 32, 16, dtype, device, seed=3)
    _check_attention(case, dtype, num_kv_splits=splits)


@pytest.mark.gpu
def test_paged_attention_small_tiles_cover_long_prefill(device):
    # Several query tiles per request and several KV tiles per query tile.
    case = _attention_case([37, 1, 20], [37, 50, 45], 4, 2, 16, 16, torch.float32, device, seed=4)
    _check_attention(case, torch.float32, block_q=8, block_n=16)


def test_get_ops_selects_backends_and_refuses_triton_on_cpu_without_interpreter(monkeypatch):
    import kernels

    assert kernels.get_ops("torch", "cuda").paged_attention is ref.paged_attention
    assert kernels.get_ops("triton", "cpu").paged_attention is tk.paged_attention  # interpreter on
    assert kernels.default_backend("cuda") == "triton" and kernels.default_backend("cpu") == "torch"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CUDA"):
        kernels.get_ops("triton", "cpu")
    with pytest.raises(ValueError, match="kernel backend"):
        kernels.get_ops("cuda")
