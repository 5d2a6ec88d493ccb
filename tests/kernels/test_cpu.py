"""The native CPU paged attention (kernels.cpu) against the torch reference and the naive
per-request attention."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

import kernels
from kernels import cpu
from kernels import reference as ref
from tests.kernels.test_reference import _naive_attention, _paged_inputs, one_token_per_page

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="no C compiler")


@needs_compiler
def test_native_library_builds_where_a_compiler_exists():
    assert cpu.library() is not None


def test_cpu_ops_route_paged_attention_through_the_native_wrapper():
    assert kernels.get_ops("torch", "cpu").paged_attention is cpu.paged_attention
    assert kernels.get_ops("torch", "cpu").rms_norm is ref.rms_norm


@needs_compiler
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


@needs_compiler
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


@needs_compiler
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
