"""The native CPU kernels (kernels.cpu) against the torch references (and paged attention
against the naive per-request attention)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

import kernels
from kernels import cpu
from kernels import reference as ref
from kernels.cpu import build
from tests.kernels.test_reference import _naive_attention, _paged_inputs, one_token_per_page


def test_native_library_builds():
    # The set-up machines have gcc (a machine without a compiler runs the references, which
    # the other kernel tests cover); here the C kernels must build and be the ones tested.
    assert shutil.which("cc") or shutil.which("gcc"), "no C compiler on this machine"
    assert build.library() is not None


def test_cpu_ops_route_through_the_native_wrappers():
    ops = kernels.get_ops("torch", "cpu")
    for name in ("paged_attention", "rms_norm", "silu_and_mul", "rotary_embedding", "reshape_and_cache"):
        assert getattr(ops, name) is getattr(cpu, name)
    assert ops.fused_moe is ref.fused_moe


@pytest.mark.parametrize("H, Hkv", [(4, 4), (8, 2), (9, 3), (4, 1)])
@pytest.mark.parametrize("D", [8, 64, 80])
def test_native_matches_naive_on_decodes_short_chunks_and_prefills(H, Hkv, D):
    long = cpu.NATIVE_MAX_QUERY_LEN + 4  # runs through the reference's prefill path
    q_lens = [1, 5, 1, long, 1, cpu.NATIVE_MAX_QUERY_LEN, 3]
    ctx_lens = [33, 9, 1, long + 7, 47, cpu.NATIVE_MAX_QUERY_LEN, 3]
    q, kc, vc, table, qsl, seq_lens, dense = _paged_inputs(q_lens, ctx_lens, H, Hkv, D, 16, 40)
    scale = 1 / math.sqrt(D)
    out = cpu.paged_attention(q, kc, vc, table, qsl, seq_lens, scale)
    torch.testing.assert_close(out, _naive_attention(q, dense, q_lens, ctx_lens, scale), atol=1e-5, rtol=1e-5)


def test_prefills_in_query_blocks_match_naive_across_block_edges_and_past_the_blocked_limit():
    B = cpu.QUERY_BLOCK
    # A whole prompt over several blocks, a chunk over a cached prefix ending mid-block, a
    # decode beside them, and a prompt past BLOCKED_MAX_CONTEXT (one causal SDPA call).
    q_lens = [2 * B + 5, B + 9, 1, cpu.BLOCKED_MAX_CONTEXT + 3]
    ctx_lens = [2 * B + 5, B + 9 + 40, 20, cpu.BLOCKED_MAX_CONTEXT + 3]
    q, kc, vc, table, qsl, seq_lens, dense = _paged_inputs(q_lens, ctx_lens, 8, 2, 64, 16, 90)
    out = cpu.paged_attention(q, kc, vc, table, qsl, seq_lens, 0.125)
    expected = _naive_attention(q, dense, q_lens, ctx_lens, 0.125)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_native_matches_reference_on_a_large_decode_batch_with_page_size_one():
    g = torch.Generator().manual_seed(7)
    ctx_lens = torch.randint(1, 300, (64,), generator=g).tolist()
    q_lens = [1] * 64
    q, kc, vc, table, qsl, seq_lens, dense = _paged_inputs(q_lens, ctx_lens, 8, 4, 64, 16, 1300, seed=8)
    expected = ref.paged_attention(q, kc, vc, table, qsl, seq_lens, 0.125)
    torch.testing.assert_close(cpu.paged_attention(q, kc, vc, table, qsl, seq_lens, 0.125), expected,
                               atol=1e-5, rtol=1e-5)
    pages = one_token_per_page(dense, ctx_lens)
    torch.testing.assert_close(cpu.paged_attention(q, *pages, qsl, seq_lens, 0.125), expected,
                               atol=1e-5, rtol=1e-5)


def test_native_reads_strided_queries_and_writes_only_into_out():
    q_lens, ctx_lens = [1, 2, 1], [20, 6, 35]
    q, kc, vc, table, qsl, seq_lens, _ = _paged_inputs(q_lens, ctx_lens, 4, 2, 16, 16, 8, seed=3)
    # Queries as a view into a fused projection: rows strided past the heads.
    fused = torch.randn(q.shape[0], 4 * 16 + 32)
    fused[:, :64] = q.reshape(q.shape[0], -1)
    q_view = fused[:, :64].view(q.shape[0], 4, 16)
    out = torch.full_like(q, float("nan"))
    res = cpu.paged_attention(q_view, kc, vc, table, qsl, seq_lens, 0.25, out=out)
    assert res is out
    torch.testing.assert_close(out, ref.paged_attention(q, kc, vc, table, qsl, seq_lens, 0.25),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_other_dtypes_fall_back_to_the_reference(dtype):
    q, kc, vc, table, qsl, seq_lens, _ = _paged_inputs([1, 3], [10, 12], 4, 2, 16, 16, 4, seed=4)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    assert torch.equal(cpu.paged_attention(q, kc, vc, table, qsl, seq_lens, 0.25),
                       ref.paged_attention(q, kc, vc, table, qsl, seq_lens, 0.25))


def test_head_dim_not_a_multiple_of_eight_falls_back_to_the_reference():
    q, kc, vc, table, qsl, seq_lens, _ = _paged_inputs([1, 1], [10, 30], 4, 2, 12, 16, 4, seed=5)
    assert torch.equal(cpu.paged_attention(q, kc, vc, table, qsl, seq_lens, 0.25),
                       ref.paged_attention(q, kc, vc, table, qsl, seq_lens, 0.25))


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shape", [(5, 96), (70, 512), (3, 4, 64)])
def test_rms_norm_matches_reference(with_residual, shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g)
    w = 1 + 0.1 * torch.randn(shape[-1], generator=g)
    res = torch.randn(*shape, generator=g) if with_residual else None
    before = (x.clone(), None if res is None else res.clone())
    a, b = ref.rms_norm(x, w, 1e-6, res), cpu.rms_norm(x, w, 1e-6, res)
    if with_residual:
        _close(b[0], a[0])
        _close(b[1], a[1])
        assert torch.equal(res, before[1])  # inputs untouched, as the reference leaves them
    else:
        _close(b, a)
    assert torch.equal(x, before[0])


def test_rms_norm_reads_strided_rows():
    x = torch.randn(6, 80)[:, :64]
    w = torch.rand(64) + 0.5
    _close(cpu.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))


def test_silu_and_mul_matches_reference_over_the_whole_exp_range():
    x = torch.linspace(-120, 120, 40 * 64).view(40, 64)
    x[::3] = torch.randn(14, 64) * 4
    _close(cpu.silu_and_mul(x), ref.silu_and_mul(x))
    strided = torch.randn(9, 100)[:, :64]
    _close(cpu.silu_and_mul(strided), ref.silu_and_mul(strided))


@pytest.mark.parametrize("rot", [64, 32])  # full and partial rotary
def test_rotary_neox_matches_reference_on_fused_qkv_views(rot):
    from engine.models.rotary import cos_sin_cache

    g = torch.Generator().manual_seed(2)
    T, H, Hkv, D = 11, 4, 2, 64
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g)
    q, k, _ = qkv.split([H * D, Hkv * D, Hkv * D], -1)
    q, k = q.view(T, H, D), k.view(T, Hkv, D)
    cache = cos_sin_cache(rot, 512, 10000.0, None)
    positions = torch.randint(0, 512, (T,), generator=g)
    for a, b in zip(cpu.rotary_embedding(positions, q, k, cache), ref.rotary_embedding(positions, q, k, cache)):
        _close(a, b)


def test_reshape_and_cache_writes_slots_and_skips_padding_from_strided_views():
    qkv = torch.randn(7, (4 + 2 * 2) * 16)
    _, k, v = qkv.split([64, 32, 32], dim=-1)
    k, v = k.view(7, 2, 16), v.view(7, 2, 16)
    slots = torch.tensor([3, -1, 17, 0, -1, 31, 8])
    caches = [torch.zeros(4, 8, 2, 16) for _ in range(4)]
    ref.reshape_and_cache(k, v, caches[0], caches[1], slots)
    cpu.reshape_and_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
