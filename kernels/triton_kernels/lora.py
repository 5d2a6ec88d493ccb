"""LoRA shrink and expand for a batch that mixes adapters (contract and spec in
kernels.reference.lora_shrink / lora_expand; the grouping in kernels.lora_mapping).

Both kernels walk the adapter tokens of `mapping.order` (sorted by slot) BLOCK_T at a time.
Grid: (token tiles, output-column blocks, groups per tile). The order being sorted, the groups
of a tile are consecutive group indices, and program j of a tile takes its j-th group: each
program reads one adapter's weights and writes only its own rows, so there are no atomics and
the result does not depend on the schedule. A prefill tile is mostly one group (the programs
past a tile's last group exit at once); a decode tile of many adapters runs them in parallel
rather than in a loop. The third axis is min(BLOCK_T, groups), known on the host: the launch
reads no device data and can be captured in a CUDA graph.

A token's group is padded_rows // width (the CPU path's padded layout). Base-model tokens are
not in `order`: shrink leaves their rows zero and expand never touches them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _tile_group(order_ptr, padded_ptr, num_rows, width, BLOCK_T: tl.constexpr):
    """(rows, mine, g, last) of this program: its tile's token rows [BLOCK_T] (int64), which of
    them are in its group g, and the tile's last group (g > last: the tile has no j-th group)."""
    idx = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = idx < num_rows
    rows = tl.load(order_ptr + idx, mask=valid, other=0)
    group = tl.load(padded_ptr + idx, mask=valid, other=0) // width
    # A group index is < num_rows, so num_rows is a safe "none" for the min.
    first = tl.min(tl.where(valid, group, num_rows), axis=0)
    last = tl.max(tl.where(valid, group, -1), axis=0)
    g = first + tl.program_id(2)
    return rows, valid & (group == g), g, last


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, out_ptr, order_ptr, padded_ptr, group_slots_ptr,
    num_rows, width, K, R,
    x_stride, a_sl, a_sr, out_stride,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    rows, mine, g, last = _tile_group(order_ptr, padded_ptr, num_rows, width, BLOCK_T)
    if g > last:
        return
    slot = tl.load(group_slots_ptr + g)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    a_base = a_ptr + slot * a_sl
    acc = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * x_stride + offs_k[None, :],
                    mask=mine[:, None] & k_mask[None, :], other=0.0)  # [BT, BK]
        a = tl.load(a_base + offs_r[None, :] * a_sr + offs_k[:, None],
                    mask=k_mask[:, None] & r_mask[None, :], other=0.0)  # [BK, BR]: A^T tile
        if UPCAST:  # the interpreter's dot has no bf16; fp32 inputs want exact (not tf32) products
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:  # 16-bit x 16-bit: the products are exact, accumulated in fp32
            acc += tl.dot(x, a)
    tl.store(out_ptr + rows[:, None] * out_stride + offs_r[None, :], acc,
             mask=mine[:, None] & r_mask[None, :])


@triton.jit
def _expand_kernel(
    y_ptr, s_ptr, b_ptr, order_ptr, padded_ptr, group_slots_ptr,
    num_rows, width, N, R,
    y_stride, s_stride, b_sl, b_sn,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
):
    rows, mine, g, last = _tile_group(order_ptr, padded_ptr, num_rows, width, BLOCK_T)
    if g > last:
        return
    slot = tl.load(group_slots_ptr + g)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    b_base = b_ptr + slot * b_sl
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        s = tl.load(s_ptr + rows[:, None] * s_stride + offs_r[None, :],
                    mask=mine[:, None] & r_mask[None, :], other=0.0).to(tl.float32)  # [BT, BR]
        b = tl.load(b_base + offs_n[None, :] * b_sn + offs_r[:, None],
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)  # [BR, BN]: B^T
        acc += tl.dot(s, b, input_precision=PRECISION)
    y_ptrs = y_ptr + rows[:, None] * y_stride + offs_n[None, :]
    y_mask = mine[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=y_mask)  # rounded once, like the spec


def _block_t(num_rows: int) -> int:
    """Token tile: 16 (tl.dot's smallest) for decode-sized steps, 64 for prefill, where a taller
    tile reads each adapter's weights for more tokens."""
    return 16 if _INTERPRET or num_rows <= 128 else 64


def _check_mapping(mapping, T: int, device: torch.device) -> None:
    assert mapping.token_slots.shape == (T,), "mapping is for another step"
    for t in (mapping.order, mapping.padded_rows, mapping.slots):
        assert t.device == device and t.dtype == torch.int64 and t.is_contiguous()


def lora_shrink(x, a_stack, mapping):
    T, K = x.shape
    R = a_stack.shape[1]
    assert x.stride(1) == 1 and a_stack.shape[2] == K and a_stack.stride(2) == 1
    _check_mapping(mapping, T, x.device)
    out = torch.zeros((T, R), dtype=torch.float32, device=x.device)
    n = mapping.num_lora_tokens
    if n == 0:
        return out
    bt = _block_t(n)
    br = max(16, min(triton.next_power_of_2(R), 64))
    upcast = _INTERPRET or x.dtype == torch.float32 or x.dtype != a_stack.dtype
    grid = (triton.cdiv(n, bt), triton.cdiv(R, br), min(bt, mapping.slots.shape[0]))
    _shrink_kernel[grid](
        x, a_stack, out, mapping.order, mapping.padded_rows, mapping.slots,
        n, mapping.width, K, R,
        x.stride(0), a_stack.stride(0), a_stack.stride(1), out.stride(0),
        BLOCK_T=bt, BLOCK_R=br, BLOCK_K=64, UPCAST=upcast,
    )
    return out


def lora_expand(y, s, b_stack, mapping) -> None:
    T, N = y.shape
    R = b_stack.shape[2]
    assert y.stride(1) == 1 and s.shape == (T, R) and s.stride(1) == 1
    assert b_stack.shape[1] == N and b_stack.stride(2) == 1
    _check_mapping(mapping, T, y.device)
    n = mapping.num_lora_tokens
    if n == 0:
        return
    bt = _block_t(n)
    bn = 32 if _INTERPRET else 64
    # s is fp32: with 16-bit B on a GPU, tf32 keeps 10 mantissa bits of s (as many as fp16's y
    # is rounded to, more than bf16's) and runs on tensor cores; fp32 B gets exact products.
    precision = "ieee" if _INTERPRET or b_stack.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(n, bt), triton.cdiv(N, bn), min(bt, mapping.slots.shape[0]))
    _expand_kernel[grid](
        y, s, b_stack, mapping.order, mapping.padded_rows, mapping.slots,
        n, mapping.width, N, R,
        y.stride(0), s.stride(0), b_stack.stride(0), b_stack.stride(1),
        BLOCK_T=bt, BLOCK_N=bn, BLOCK_R=max(16, min(triton.next_power_of_2(R), 64)), PRECISION=precision,
    )


def lora_apply(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor, mapping) -> None:
    """kernels.reference.lora_apply: the two kernels back to back (the shrink's [T, R] output
    is small at LoRA ranks, so fusing would save little traffic)."""
    lora_expand(y, lora_shrink(x, a_stack, mapping), b_stack, mapping)
