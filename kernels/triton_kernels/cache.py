"""reshape_and_cache: scatter each token's K/V into its paged slot."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    k_stride_t, k_stride_h, v_stride_t, v_stride_h,
    c_stride_slot, c_stride_h,
    NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    # slot -1 is padding: no write. (Broadcast the slot first: the interpreter cannot `&` a
    # tensor with a scalar bool.)
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM) & ((h * 0 + slot) >= 0)
    k = tl.load(key_ptr + t * k_stride_t + h * k_stride_h + d, mask=mask)
    v = tl.load(value_ptr + t * v_stride_t + h * v_stride_h + d, mask=mask)
    dst = slot * c_stride_slot + h * c_stride_h + d
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """key/value [T, Hkv, D] (head dim contiguous; other strides free), caches
    [num_blocks, block_size, Hkv, D] contiguous, slot_mapping [T] with -1 = skip."""
    T, hkv, d = key.shape
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be contiguous"
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    assert key_cache.shape[2:] == (hkv, d) and value_cache.shape == key_cache.shape
    if T == 0:
        return
    _reshape_and_cache_kernel[(T,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(1), key_cache.stride(2),
        NUM_KV_HEADS=hkv, BLOCK_H=triton.next_power_of_2(hkv), HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
    )
