"""The torch references obey the kernel contract of docs/architecture.md#kernels, checked against
naive per-request implementations."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import reference as ref


def _paged_inputs(q_lens, ctx_lens, H, Hkv, D, block_size, num_blocks, seed=0):
    """Random paged KV with a random (shuffled) block assignment per request, plus the
    dense per-request K/V the naive attention uses."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(num_blocks, block_size, Hkv, D, generator=g)
    vc = torch.randn(num_blocks, block_size, Hkv, D, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(-(-c // block_size) for c in ctx_lens)
    table = torch.zeros(len(ctx_lens), max_blocks, dtype=torch.int32)
    used = 0
    dense = []
    for r, c in enumerate(ctx_lens):
        n = -(-c // block_size)
        table[r, :n] = perm[used : used + n].int()
        used += n
        k = kc[table[r, :n].long()].reshape(-1, Hkv, D)[:c]
        v = vc[table[r, :n].long()].reshape(-1, Hkv, D)[:c]
        dense.append((k, v))
    q = torch.randn(sum(q_lens), H, D, generator=g)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, kc, vc, table, qsl, torch.tensor(ctx_lens, dtype=torch.int32), dense


def one_token_per_page(dense, ctx_lens):
    """The same per-request K/V laid out with page size 1: (key_cache, value_cache, table)."""
    kc1 = torch.cat([k for k, _ in dense]).unsqueeze(1)
    vc1 = torch.cat([v for _, v in dense]).unsqueeze(1)
    offsets = torch.tensor([0, *torch.tensor(ctx_lens).cumsum(0).tolist()])
    table1 = torch.zeros(len(ctx_lens), max(ctx_lens), dtype=torch.int32)
    for r, c in enumerate(ctx_lens):
        table1[r, :c] = torch.arange(offsets[r], offsets[r] + c)
    return kc1, vc1, table1


def _naive_attention(q, dense, q_lens, ctx_lens, scale):
    outs = []
    start = 0
    for (k, v), ql, c in zip(dense, q_lens, ctx_lens):
        H, Hkv = q.shape[1], k.shape[1]
        rep = H // Hkv
        for i in range(ql):
            qi = q[start + i]  # [H, D]
            visible = c - ql + i + 1
            kk = k[:visible].repeat_interleave(rep, dim=1)  # [visible, H, D]
            vv = v[:visible].repeat_interleave(rep, dim=1)
            scores = torch.einsum("hd,khd->hk", qi, kk) * scale
            outs.append(torch.einsum("hk,khd->hd", scores.softmax(-1), vv))
        start += ql
    return torch.stack(outs)


@pytest.mark.parametrize("H, Hkv", [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("D", [16, 64])
def test_paged_attention_matches_naive_on_mixed_batch(H, Hkv, D):
    q_lens = [5, 1, 1, 12, 1]  # prefill chunks over cached prefixes and decodes
    ctx_lens = [9, 33, 1, 12, 47]
    q, kc, vc, table, qsl, seq_lens, dense = _paged_inputs(q_lens, ctx_lens, H, Hkv, D, 16, 24)
    scale = 1 / math.sqrt(D)
    out = ref.paged_attention(q, kc, vc, table, qsl, seq_lens, scale)
    assert torch.allclose(out, _naive_attention(q, dense, q_lens, ctx_lens, scale), atol=1e-5)


def test_paged_attention_decode_only_batch():
    q_lens, ctx_lens = [1, 1, 1], [17, 3, 40]
    q, kc, vc, table, qsl, seq_lens, dense = _paged_inputs(q_lens, ctx_lens, 8, 2, 32, 16, 12, seed=1)
    out = ref.paged_attention(q, kc, vc, table, qsl, seq_lens, 0.2)
    assert torch.allclose(out, _naive_attention(q, dense, q_lens, ctx_lens, 0.2), atol=1e-5)


def test_paged_attention_is_page_size_invariant():
    q_lens, ctx_lens = [3, 1, 7], [20, 35, 7]
    q, kc, vc, table, qsl, seq_lens, dense = _paged_inputs(q_lens, ctx_lens, 4, 2, 16, 16, 8, seed=2)
    out16 = ref.paged_attention(q, kc, vc, table, qsl, seq_lens, 0.25)
    out1 = ref.paged_attention(q, *one_token_per_page(dense, ctx_lens), qsl, seq_lens, 0.25)
    assert torch.allclose(out16, out1, atol=1e-6)


def test_paged_attention_writes_into_out():
    q, kc, vc, table, qsl, seq_lens, _ = _paged_inputs([2, 1], [5, 9], 4, 2, 16, 4, 8)
    out = torch.empty_like(q)
    res = ref.paged_attention(q, kc, vc, table, qsl, seq_lens, 0.25, out=out)
    assert res is out and torch.allclose(out, ref.paged_attention(q, kc, vc, table, qsl, seq_lens, 0.25))


def test_reshape_and_cache_writes_slots_and_skips_padding():
    kc = torch.zeros(4, 4, 2, 8)
    vc = torch.zeros(4, 4, 2, 8)
    k = torch.randn(3, 2, 8)
    v = torch.randn(3, 2, 8)
    ref.reshape_and_cache(k, v, kc, vc, torch.tensor([5, -1, 14]))
    assert torch.equal(kc[1, 1], k[0]) and torch.equal(vc[3, 2], v[2])
    assert int((kc != 0).any(-1).any(-1).sum()) == 2  # the -1 token wrote nothing


def test_rms_norm_with_residual_returns_normed_sum_and_sum():
    x, res, w = torch.randn(5, 32), torch.randn(5, 32), torch.randn(32)
    out, new_res = ref.rms_norm(x, w, 1e-6, res)
    s = x + res
    expected = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(new_res, s) and torch.allclose(out, expected, atol=1e-6)


def _rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def test_rotary_neox_matches_rotate_half_formulation():
    from engine.models.rotary import cos_sin_cache

    D = 16
    cache = cos_sin_cache(D, 64, 10000.0, None)
    pos = torch.tensor([0, 3, 63])
    q, k = torch.randn(3, 4, D), torch.randn(3, 2, D)
    rq, rk = ref.rotary_embedding(pos, q, k, cache, is_neox=True)
    cos, sin = cache[pos].chunk(2, -1)
    cos, sin = torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((sin, sin), -1).unsqueeze(1)
    assert torch.allclose(rq, q * cos + _rotate_half(q) * sin, atol=1e-6)
    assert torch.allclose(rk, k * cos + _rotate_half(k) * sin, atol=1e-6)


def test_rotary_gptj_rotates_interleaved_pairs():
    from engine.models.rotary import cos_sin_cache

    D = 8
    cache = cos_sin_cache(D, 16, 10000.0, None)
    pos = torch.tensor([5])
    q, k = torch.randn(1, 1, D), torch.randn(1, 1, D)
    rq, _ = ref.rotary_embedding(pos, q, k, cache, is_neox=False)
    cos, sin = cache[5].chunk(2)
    for j in range(D // 2):
        a, b = q[0, 0, 2 * j], q[0, 0, 2 * j + 1]
        assert torch.allclose(rq[0, 0, 2 * j], a * cos[j] - b * sin[j], atol=1e-6)
        assert torch.allclose(rq[0, 0, 2 * j + 1], b * cos[j] + a * sin[j], atol=1e-6)


def test_rotary_at_position_zero_is_identity():
    from engine.models.rotary import cos_sin_cache

    cache = cos_sin_cache(8, 4, 10000.0, None)
    q, k = torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    rq, rk = ref.rotary_embedding(torch.tensor([0]), q, k, cache)
    assert torch.allclose(rq, q) and torch.allclose(rk, k)


def test_silu_and_mul():
    x = torch.randn(3, 10)
    assert torch.allclose(ref.silu_and_mul(x), torch.nn.functional.silu(x[:, :5]) * x[:, 5:])


@pytest.mark.parametrize("min_saved", [0, 10**12])  # split into many buckets / never split
def test_paged_attention_large_decode_batch_with_spread_lengths(monkeypatch, min_saved):
    monkeypatch.setattr(ref, "_SPLIT_MIN_SAVED_ELEMS", min_saved)
    g = torch.Generator().manual_seed(3)
    ctx_lens = torch.randint(1, 90, (40,), generator=g).tolist()
    q_lens = [1] * 40
    q, kc, vc, table, qsl, seq_lens, dense = _paged_inputs(q_lens, ctx_lens, 4, 2, 16, 16, 260, seed=4)
    out = ref.paged_attention(q, kc, vc, table, qsl, seq_lens, 0.25)
    assert torch.allclose(out, _naive_attention(q, dense, q_lens, ctx_lens, 0.25), atol=1e-5)


def test_paged_attention_chunk_over_cached_prefix_mixed_with_many_decodes():
    q_lens = [1] * 33 + [6]
    ctx_lens = list(range(2, 35)) + [30]
    q, kc, vc, table, qsl, seq_lens, dense = _paged_inputs(q_lens, ctx_lens, 8, 2, 16, 16, 80, seed=5)
    out = ref.paged_attention(q, kc, vc, table, qsl, seq_lens, 0.25)
    assert torch.allclose(out, _naive_attention(q, dense, q_lens, ctx_lens, 0.25), atol=1e-5)


def test_length_buckets_split_only_where_padding_saved_is_worth_a_call():
    ctx = {r: n for r, n in enumerate([10, 11, 12, 13, 500, 510, 520, 530])}
    rows = sorted(ctx, key=ctx.get)
    buckets = ref._length_buckets(rows, ctx, elems_per_token=1024)
    assert buckets == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ref._length_buckets(rows, ctx, elems_per_token=1) == [rows]
