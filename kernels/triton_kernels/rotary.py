"""Rotary position embedding for q and k (neox and GPT-J pairings)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(src_ptr, dst_ptr, t, s_t, s_h, d_t, d_h, cos, sin, j, num_heads, head_dim,
            ROT_HALF: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    hm = h < num_heads
    jm = j < ROT_HALF
    if IS_NEOX:
        i1, i2 = j, j + ROT_HALF
    else:
        i1, i2 = 2 * j, 2 * j + 1
    m = hm & jm
    x1 = tl.load(src_ptr + t * s_t + h * s_h + i1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + t * s_t + h * s_h + i2, mask=m, other=0.0).to(tl.float32)
    ty = dst_ptr.dtype.element_ty
    tl.store(dst_ptr + t * d_t + h * d_h + i1, (x1 * cos - x2 * sin).to(ty), mask=m)
    tl.store(dst_ptr + t * d_t + h * d_h + i2, (x2 * cos + x1 * sin).to(ty), mask=m)
    # Dims past the rotary part pass through unchanged.
    p = 2 * ROT_HALF + tl.arange(0, BLOCK_D)[None, :]
    pm = hm & (p < head_dim)
    tl.store(dst_ptr + t * d_t + h * d_h + p, tl.load(src_ptr + t * s_t + h * s_h + p, mask=pm), mask=pm)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr, qo_ptr, ko_ptr,
    q_st, q_sh, k_st, k_sh, qo_st, qo_sh, ko_st, ko_sh, cache_stride,
    num_q_heads, num_k_heads, head_dim,
    ROT_HALF: tl.constexpr, IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, BLOCK_R)[None, :]
    jm = j < ROT_HALF
    cos = tl.load(cache_ptr + pos * cache_stride + j, mask=jm, other=1.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * cache_stride + ROT_HALF + j, mask=jm, other=0.0).to(tl.float32)
    _rotate(q_ptr, qo_ptr, t, q_st, q_sh, qo_st, qo_sh, cos, sin, j, num_q_heads, head_dim,
            ROT_HALF, IS_NEOX, BLOCK_H, BLOCK_D)
    _rotate(k_ptr, ko_ptr, t, k_st, k_sh, ko_st, ko_sh, cos, sin, j, num_k_heads, head_dim,
            ROT_HALF, IS_NEOX, BLOCK_H, BLOCK_D)


def rotary_embedding(positions, q, k, cos_sin_cache, is_neox=True):
    """positions [T]; q [T, H, D]; k [T, Hkv, D] (head dim contiguous); cos_sin_cache
    [max_pos, rot_dim] = cat(cos, sin). Returns new (q, k)."""
    T, H, D = q.shape
    hkv = k.shape[1]
    rot = cos_sin_cache.shape[-1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin_cache.stride(1) == 1
    qo = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((T, hkv, D), dtype=k.dtype, device=k.device)
    if T:
        _rotary_kernel[(T,)](
            positions, q, k, cos_sin_cache, qo, ko,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), cos_sin_cache.stride(0),
            H, hkv, D,
            ROT_HALF=rot // 2, IS_NEOX=is_neox, BLOCK_H=triton.next_power_of_2(max(H, hkv)),
            BLOCK_R=triton.next_power_of_2(rot // 2), BLOCK_D=triton.next_power_of_2(max(D - rot, 1)),
        )
    return qo, ko
