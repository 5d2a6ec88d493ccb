"""Paged attention over a flattened mixed batch (prefill chunks and decodes in one launch).

Grid: (query tiles, KV heads, KV splits). A program owns BLOCK_Q query tokens of one request
and all G = H / Hkv query heads that share one KV head, laid out as BLOCK_M = BLOCK_Q * G_PAD
rows of one tl.dot, so GQA reads each K/V tile once per group. The request of a tile is found
by binary search over `query_start_loc // BLOCK_Q + r` (monotonic, and it leaves every request
enough tiles), so the launch needs no host sync and can be captured in a CUDA graph.

K/V are addressed per token through the block table, so the tile size BLOCK_N is independent
of the page size. With NUM_SPLITS > 1 (decode-only batches with few programs), each split
covers a contiguous share of the context and writes an unnormalised partial result that
`_reduce_splits_kernel` merges (split-KV / flash-decoding).

Sliding window (WINDOWED, runtime `window`): a tile's KV range starts at the first key its
first query sees, so a decode costs O(window); keys before that are masked out of the loads,
never read (their blocks may be freed). Softcap (SOFTCAPPED, runtime `softcap`): scores pass
through softcap * tanh(s / softcap) before masking. Both flags are constexpr so the plain
path compiles exactly as without them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _find_request(qsl_ptr, tile, num_reqs, BLOCK_Q: tl.constexpr):
    """Largest r in [0, num_reqs) with qsl[r] // BLOCK_Q + r <= tile."""
    lo = 0
    hi = num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(start <= tile, mid, lo)
        hi = tl.where(start <= tile, hi, mid - 1)
    return lo


@triton.jit
def _tanh(x):
    """tanh from exp(-2|x|), in (0, 1]: no overflow for any score (tl has no tanh)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, qsl_ptr, seq_lens_ptr, out_ptr,
    part_acc_ptr, part_ml_ptr,
    scale, window, softcap, num_reqs, num_tokens,
    q_st, q_sh, o_st, o_sh, c_sb, c_so, c_sh, bt_stride,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAPPED: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD

    r = _find_request(qsl_ptr, tile, num_reqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    ctx = tl.load(seq_lens_ptr + r)
    first = (tile - (q_start // BLOCK_Q + r)) * BLOCK_Q  # first query of this tile in the request

    m_idx = tl.arange(0, BLOCK_M)
    qi = first + m_idx // G_PAD  # query index within the request
    head = kvh * GROUP + m_idx % G_PAD
    row_ok = (qi < q_len) & (m_idx % G_PAD < GROUP)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    tok = (q_start + qi).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * q_st + head[:, None] * q_sh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Causal bound: query qi sees keys [0, ctx - q_len + qi].
    last_key = ctx - q_len + qi  # [BLOCK_M]
    tile_end = tl.minimum(ctx - q_len + first + BLOCK_Q, ctx)  # keys this tile may need
    tile_end = tl.where(first < q_len, tile_end, 0)
    if WINDOWED:
        # The tile's first query sees the earliest keys; the splits share [kv_first, tile_end)
        # from the BLOCK_N boundary below kv_first (loads below kv_first are masked).
        kv_first = tl.maximum(ctx - q_len + first - window + 1, 0)
        kv_base = kv_first // BLOCK_N * BLOCK_N
        per_split = tl.cdiv(tl.cdiv(tile_end - kv_base, BLOCK_N), NUM_SPLITS) * BLOCK_N
        kv_lo = kv_base + split * per_split
    else:
        per_split = tl.cdiv(tl.cdiv(tile_end, BLOCK_N), NUM_SPLITS) * BLOCK_N
        kv_lo = split * per_split
    kv_hi = tl.minimum(kv_lo + per_split, tile_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2(e): the softmax works in base 2
    for n0 in range(kv_lo, kv_hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_hi
        if WINDOWED:
            pos_ok = pos_ok & (pos >= kv_first)
        page = tl.load(block_table_ptr + r * bt_stride + pos // PAGE, mask=pos_ok, other=0).to(tl.int64)
        kv_off = page * c_sb + (pos % PAGE) * c_so + kvh * c_sh
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if UPCAST:  # fp32 math: no TF32 shortcuts on GPU
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
        else:
            s = tl.dot(q, tl.trans(k))
        if SOFTCAPPED:
            s = softcap * _tanh(s * (scale / softcap)) * 1.4426950408889634
        else:
            s = s * qk_scale
        visible = (pos[None, :] <= last_key[:, None]) & pos_ok[None, :] & row_ok[:, None]
        if WINDOWED:
            visible = visible & (pos[None, :] > last_key[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    o_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + tok[:, None] * o_st + head[:, None] * o_sh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        # partials: acc [S, T, H, D], (m, l) [S, T, H, 2]
        row = (split.to(tl.int64) * num_tokens + tok) * NUM_HEADS + head
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=o_mask)
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _reduce_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, num_tokens, o_st, o_sh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    row = (s.to(tl.int64) * num_tokens + t) * NUM_HEADS + h
    m = tl.load(part_ml_ptr + row * 2, mask=s_ok, other=float("-inf"))
    l_sum = tl.load(part_ml_ptr + row * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    total = tl.sum(w * l_sum, axis=0)
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :],
                  mask=s_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + t * o_st + h * o_sh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def default_num_splits(num_reqs: int, num_kv_heads: int, decode_only: bool, device: torch.device) -> int:
    """Split the context only for decode-only batches that would leave the GPU idle: aim for
    about two programs per SM."""
    if not decode_only or device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = num_reqs * num_kv_heads
    return int(max(1, min(16, (2 * sms) // max(programs, 1))))


def paged_attention(q, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale,
                    out=None, *, sliding_window: int = 0, softcap: float = 0.0,
                    num_kv_splits: int | None = None, block_q: int | None = None,
                    block_n: int | None = None):
    """Contract of kernels.reference.paged_attention. The keyword-only extras after softcap
    tune the launch (tests use them to exercise split-KV and small tiles)."""
    T, H, D = q.shape
    num_blocks, page, hkv, d2 = key_cache.shape
    assert d2 == D and H % hkv == 0, "q heads must be a multiple of KV heads"
    assert q.stride(2) == 1 and key_cache.is_contiguous() and value_cache.is_contiguous()
    R = seq_lens.shape[0]
    if out is None:
        out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    group = H // hkv
    g_pad = triton.next_power_of_2(group)
    # BLOCK_M = BLOCK_Q * G_PAD rows feed tl.dot, which needs at least 16.
    bq = block_q or max(1, (16 if _INTERPRET else 64) // g_pad)
    bq = max(bq, triton.cdiv(16, g_pad))
    bn = block_n or (16 if _INTERPRET else 64)
    decode_only = T == R  # every request has at least one token, so T == R means one each
    splits = num_kv_splits or default_num_splits(R, hkv, decode_only, q.device)
    num_tiles = T // bq + R  # upper bound of sum(cdiv(q_len, bq)); extra tiles exit early
    if splits > 1:
        part_acc = torch.empty((splits, T, H, D), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((splits, T, H, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _paged_attention_kernel[(num_tiles, hkv, splits)](
        q, key_cache, value_cache, block_table, query_start_loc, seq_lens, out,
        part_acc, part_ml, scale, max(int(sliding_window), 0), max(float(softcap), 0.0), R, T,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        NUM_HEADS=H, GROUP=group, G_PAD=g_pad, HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
        PAGE=page, BLOCK_Q=bq, BLOCK_N=bn, NUM_SPLITS=splits,
        UPCAST=_INTERPRET or q.dtype == torch.float32,
        WINDOWED=sliding_window > 0, SOFTCAPPED=softcap > 0,
    )
    if splits > 1:
        _reduce_splits_kernel[(T, H)](
            part_acc, part_ml, out, T, out.stride(0), out.stride(1),
            NUM_HEADS=H, HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
            NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
        )
    return out
