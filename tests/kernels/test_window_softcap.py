"""Sliding-window and softcapped paged attention (Gemma 2/3) and gelu_tanh_and_mul, for the torch
reference, the C path and the Triton kernels (interpreter), against float64 oracles written here.

Every case poisons what no query may see: the blocks wholly before a request's window hold
NaN and half of their table entries point at block 0 (all NaN), as do the table columns past a
request's blocks and the unwritten slots of its last block. A single read of any of them that
reaches the output makes it NaN.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import cpu
from kernels import reference as ref
from kernels import triton_kernels as tk

NAN = float("nan")
IMPLS = {"reference": ref.paged_attention, "cpu": cpu.paged_attention, "triton": tk.paged_attention}

# (q_lens, ctx_lens). MIXED has a row longer than cpu.NATIVE_MAX_QUERY_LEN, which the C path
# hands to the reference's prefill path.
DECODE = ([1, 1, 1, 1], [1, 7, 40, 75])
CHUNKED = ([5, 9, 3], [37, 50, 12])
PREFILL = ([20, 13], [20, 13])
MIXED = ([5, 1, 1, 9, 1, 20], [21, 17, 3, 9, 34, 60])
BATCHES = {"decode": DECODE, "chunked": CHUNKED, "prefill": PREFILL, "mixed": MIXED}
# (sliding_window, softcap), pages of 8: windows below, at and above the page size, one wider
# than every context, softcap alone and with a window.
FEATURES = [(1, 0.0), (5, 0.0), (8, 0.0), (13, 0.0), (100, 0.0), (0, 3.0), (13, 3.0)]


def _case(q_lens, ctx_lens, H=8, Hkv=2, D=16, page=8, window=0, seed=0):
    """Paged inputs (q, key_cache, value_cache, block_table, query_start_loc, seq_lens) with
    everything no query may see set to NaN (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    counts = [-(-c // page) for c in ctx_lens]
    num_blocks = 1 + sum(counts)
    kc = torch.randn(num_blocks, page, Hkv, D, generator=g)
    vc = torch.randn(num_blocks, page, Hkv, D, generator=g)
    kc[0] = vc[0] = NAN
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(ctx_lens), max(counts) + 1, dtype=torch.int32)  # 0: the NaN block
    for r, (ql, c, n) in enumerate(zip(q_lens, ctx_lens, counts)):
        own, free = free[:n], free[n:]
        table[r, :n] = torch.tensor(own, dtype=torch.int32)
        kc[own[-1], c - (n - 1) * page :] = vc[own[-1], c - (n - 1) * page :] = NAN
        first_visible = max(0, c - ql - window + 1) if window > 0 else 0
        for b in range(first_visible // page):  # wholly before the window: freed by the engine
            kc[own[b]] = vc[own[b]] = NAN
            if b % 2 == 0:
                table[r, b] = 0
    # Sharp scores, so that a softcap of 3 changes the result a lot.
    q = 4 * torch.randn(sum(q_lens), H, D, generator=g)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, kc, vc, table, qsl, torch.tensor(ctx_lens, dtype=torch.int32)


def _oracle(q, kc, vc, table, qsl, seq_lens, scale, window, softcap):
    """Per query, in float64: exactly its visible keys looked up through the table, scores
    softcapped, softmax, weighted values."""
    page, Hkv = kc.shape[1], kc.shape[2]
    rep = q.shape[1] // Hkv
    out = torch.empty(q.shape, dtype=torch.float64)
    starts = qsl.tolist()
    for r, c in enumerate(seq_lens.tolist()):
        q_len = starts[r + 1] - starts[r]
        for i in range(q_len):
            p = c - q_len + i
            keys = torch.arange(max(0, p - window + 1) if window > 0 else 0, p + 1)
            blocks = table[r, keys // page].long()
            k = kc[blocks, keys % page].double().repeat_interleave(rep, dim=1)  # [n, H, D]
            v = vc[blocks, keys % page].double().repeat_interleave(rep, dim=1)
            s = torch.einsum("hd,nhd->hn", q[starts[r] + i].double(), k) * scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            out[starts[r] + i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    assert torch.isfinite(out).all()
    return out


def _check(impl, case, window, softcap, atol=1e-5, **kw):
    q, kc, vc, table, qsl, seq_lens = case
    scale = 1 / math.sqrt(q.shape[-1])
    expected = _oracle(q, kc, vc, table, qsl, seq_lens, scale, window, softcap)
    out = torch.full_like(q, NAN)
    got = IMPLS[impl](q, kc, vc, table, qsl, seq_lens, scale, out, sliding_window=window, softcap=softcap, **kw)
    assert got is out and got.dtype == q.dtype
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=atol)


@pytest.fixture
def native_only(monkeypatch):
    """Fails the test if the C wrapper falls back to the whole reference."""

    def refuse(*args, **kwargs):
        raise AssertionError("the C path fell back to the reference")

    monkeypatch.setattr(ref, "paged_attention", refuse)
    monkeypatch.setattr(ref, "gelu_tanh_and_mul", refuse)


@pytest.mark.parametrize("window, softcap", FEATURES)
@pytest.mark.parametrize("batch", BATCHES)
def test_reference_matches_oracle(batch, window, softcap):
    _check("reference", _case(*BATCHES[batch], window=window), window, softcap)


@pytest.mark.parametrize("window, softcap", FEATURES)
@pytest.mark.parametrize("batch", BATCHES)
def test_cpu_matches_oracle(batch, window, softcap, native_only):
    _check("cpu", _case(*BATCHES[batch], window=window), window, softcap)


@pytest.mark.parametrize("batch, window, softcap", [
    ("decode", 5, 0.0), ("decode", 13, 3.0), ("chunked", 13, 0.0), ("chunked", 0, 3.0),
    ("prefill", 5, 0.0), ("prefill", 100, 3.0), ("mixed", 8, 0.0), ("mixed", 13, 3.0),
])
def test_triton_matches_oracle(batch, window, softcap):
    _check("triton", _case(*BATCHES[batch], window=window), window, softcap)


@pytest.mark.parametrize("impl, H, Hkv, D", [
    *[(impl, *shape) for impl in ("reference", "cpu") for shape in [(4, 4, 16), (4, 1, 32), (6, 2, 8), (8, 2, 80)]],
    ("triton", 4, 1, 32), ("triton", 6, 2, 8),
])
def test_gqa_and_head_dims(impl, H, Hkv, D):
    case = _case(*MIXED, H=H, Hkv=Hkv, D=D, window=11, seed=1)
    _check(impl, case, 11, 3.0)


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_reference_prefill_in_query_chunks(impl, monkeypatch):
    # Chunks of 4 queries: each gathers its own window; a chunk's first query sees less.
    monkeypatch.setattr(ref, "_QUERY_CHUNK", 4)
    _check(impl, _case(*MIXED, window=6, seed=7), 6, 3.0)
    _check(impl, _case(*MIXED, window=0, seed=7), 0, 3.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_long_decodes_read_only_their_window(impl):
    # Pages of 16, windows of 20: all but the last two or three blocks of each row are NaN.
    case = _case([1, 1, 1], [300, 257, 21], H=4, Hkv=2, D=16, page=16, window=20, seed=2)
    table = case[3]
    assert int((table[:, :-1] == 0).sum()) >= 10 and torch.isnan(case[1][table[0, 1].long()]).all()
    _check(impl, case, 20, 0.0)
    _check(impl, case, 20, 2.0)


@pytest.mark.parametrize("splits, window, softcap", [(3, 50, 0.0), (2, 13, 3.0)])
def test_triton_split_kv_with_a_window(splits, window, softcap):
    # 200 at a window of 50: the KV range starts mid-tile and the last split is empty.
    case = _case([1, 1, 1, 1], [70, 5, 33, 200], window=window, seed=3)
    _check("triton", case, window, softcap, num_kv_splits=splits)


def test_triton_small_tiles_start_each_query_tile_at_its_own_window():
    case = _case([37, 1, 20], [37, 50, 45], H=4, Hkv=2, window=10, seed=4)
    _check("triton", case, 10, 3.0, block_q=8, block_n=16)


@pytest.mark.parametrize("dtype, atol", [(torch.float16, 1e-2), (torch.bfloat16, 1e-1)])
def test_triton_16_bit(dtype, atol):
    q, kc, vc, table, qsl, seq_lens = _case(*CHUNKED, window=13, seed=5)
    _check("triton", (q.to(dtype), kc.to(dtype), vc.to(dtype), table, qsl, seq_lens), 13, 3.0, atol=atol)


def test_the_cases_depend_on_window_and_softcap():
    # The oracle is not blind to the features the tests above check. No NaN here: the plain
    # path's decode buckets pad shorter rows with whatever their tables point at.
    q, kc, vc, table, qsl, seq_lens = _case(*MIXED, window=0)
    args = (q, kc.nan_to_num(), vc.nan_to_num(), table, qsl, seq_lens, 0.25)
    full = _oracle(*args, 0, 0.0)
    for window, softcap in FEATURES:
        if window < max(seq_lens.tolist()):
            assert (_oracle(*args, window, softcap) - full).abs().max() > 0.1
    # Plain causal attention is the reference's unchanged fast path.
    torch.testing.assert_close(ref.paged_attention(*args).double(), full, atol=1e-5, rtol=1e-5)


def test_window_of_one_returns_each_querys_own_value():
    q, kc, vc, table, qsl, seq_lens = _case(*MIXED, H=2, Hkv=2, window=1, seed=6)
    for impl in IMPLS.values():
        out = impl(q, kc, vc, table, qsl, seq_lens, 0.25, sliding_window=1)
        starts = qsl.tolist()
        for r, c in enumerate(seq_lens.tolist()):
            p = c - 1  # the last query of each request
            expected = vc[table[r, p // kc.shape[1]].long(), p % kc.shape[1]]
            torch.testing.assert_close(out[starts[r + 1] - 1], expected)


def _gelu_oracle(x):
    x = x.double()
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def test_gelu_reference_is_tanh_gelu_of_the_first_half_times_the_second():
    x = 3 * torch.randn(3, 2, 80, generator=torch.Generator().manual_seed(7))
    out = ref.gelu_tanh_and_mul(x)
    assert out.shape == (3, 2, 40) and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), _gelu_oracle(x), atol=1e-6, rtol=1e-6)


def test_gelu_cpu_over_the_whole_exp_range_and_strided_rows(native_only):
    x = torch.linspace(-120, 120, 40 * 64).view(40, 64)
    x[::3] = torch.randn(14, 64, generator=torch.Generator().manual_seed(8)) * 4
    torch.testing.assert_close(cpu.gelu_tanh_and_mul(x).double(), _gelu_oracle(x), atol=1e-5, rtol=1e-5)
    strided = torch.randn(9, 100)[:, :64]
    torch.testing.assert_close(cpu.gelu_tanh_and_mul(strided).double(), _gelu_oracle(strided),
                               atol=1e-5, rtol=1e-5)


def test_gelu_cpu_falls_back_to_the_reference_off_multiples_of_eight():
    x = torch.randn(5, 24)  # d = 12
    assert torch.equal(cpu.gelu_tanh_and_mul(x), ref.gelu_tanh_and_mul(x))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_gelu_triton(dtype, tol):
    x = (3 * torch.randn(3, 2, 80, generator=torch.Generator().manual_seed(9))).to(dtype)
    x[0, 0, :4] = torch.tensor([-1e4, 1e4, -30.0, 0.0])  # saturated and zero gates
    got = tk.gelu_tanh_and_mul(x)
    assert got.dtype == dtype and got.shape == (3, 2, 40)
    torch.testing.assert_close(got.float(), ref.gelu_tanh_and_mul(x).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.double(), _gelu_oracle(x), atol=4 * tol, rtol=4 * tol)


def test_gelu_is_an_op_of_every_backend():
    assert kernels.get_ops("torch", "cpu").gelu_tanh_and_mul is cpu.gelu_tanh_and_mul
    assert kernels.get_ops("torch", "cuda").gelu_tanh_and_mul is ref.gelu_tanh_and_mul
    assert kernels.get_ops("triton", "cpu").gelu_tanh_and_mul is tk.gelu_tanh_and_mul
