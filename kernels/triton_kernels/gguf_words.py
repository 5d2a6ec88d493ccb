"""Decode-sized products with Q4_K and Q6_K blocks (a Q4_K_M file's two types), one token row
per program, reading each block as whole words: kernels.triton_kernels.gguf's general kernels
find every value's byte on its own, which costs ~20 instructions per weight and leaves them
far below the dense bf16 product on a GPU (docs/kernels.md#gguf-weights-on-a-gpu).

Here a program reads its rows' quants as 32-bit (Q4_K) or 16-bit (Q6_K: 210-byte blocks are
only 2-byte aligned) words, so a row's block is one contiguous load. It gathers the activation
values each nibble multiplies instead of reordering the nibbles, sums each 32-value (Q4_K) or
16-value (Q6_K) sub-block's products of raw quants, and applies the sub-block's scale and min
once per sum: about four instructions per weight for Q4_K. The weights are never formed, so
16-bit activations multiply the exact weights (fp32 products and sums), not the weights
rounded to 16 bits as the general kernels do: within the same bound of the rounded product.

Layouts (gguf.py's docstring gives them per value):
  Q4_K (144 bytes): d, dmin fp16 | 12 bytes of 6-bit scales and mins | 128 bytes of nibbles.
    Byte 16 + 32c + l (c < 4, l < 32) holds value 64c + l (low nibble) and 64c + 32 + l (high);
    sub-block j = v // 32.
  Q6_K (210 bytes): 128 bytes of low nibbles | 64 bytes of high 2-bit pairs | 16 int8 scales |
    d fp16. Value 128n + 32g + l (n < 2, g < 4, l < 32): low nibble g // 2 of byte
    64n + 32 (g % 2) + l, high bits 2g.. of byte 128 + 32n + l, scale (v // 16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WORD_TYPES = ("Q4_K", "Q6_K")


@triton.jit
def _fp16_bits(h):
    """The fp16 whose bits are the low 16 of int32 h, as fp32."""
    return (h & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _q4k_word_kernel(x_ptr, w_ptr, out_ptr, N, K, x_stride, out_stride, row_words, BLOCK_N: tl.constexpr):
    t = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    c = tl.arange(0, 4)
    i = tl.arange(0, 8)
    words = (4 + 8 * c[:, None] + i[None, :])[None, :, :]  # the 32 nibble words of a block
    xoff = 64 * c[:, None] + 4 * i[None, :]  # [4, 8]: value of byte 0's low nibble of each word
    jj_even = (2 * c) % 4  # sub-blocks 2c (low nibbles) and 2c + 1 (high) within each half of 4
    jj_odd = (2 * c + 1) % 4
    first_half = c < 2  # sub-blocks 0..3 have plain 6-bit fields
    rows = w_ptr + offs_n.to(tl.int64) * row_words
    mask3 = n_mask[:, None, None]
    xrow = x_ptr + t * x_stride
    acc = tl.zeros([BLOCK_N], tl.float32)
    for sb in range(0, K // 256):
        blk = rows + sb * 36
        q = tl.load(blk[:, None, None] + words, mask=mask3, other=0)  # [BN, 4, 8] int32
        s_lo = tl.zeros([BLOCK_N, 4], tl.float32)
        s_hi = tl.zeros([BLOCK_N, 4], tl.float32)
        xs_lo = tl.zeros([4], tl.float32)
        xs_hi = tl.zeros([4], tl.float32)
        xb = xrow + sb * 256 + xoff
        for b in tl.static_range(4):
            x_lo = tl.load(xb + b).to(tl.float32)
            x_hi = tl.load(xb + 32 + b).to(tl.float32)
            s_lo += tl.sum(((q >> (8 * b)) & 15).to(tl.float32) * x_lo[None, :, :], axis=2)
            s_hi += tl.sum(((q >> (8 * b + 4)) & 15).to(tl.float32) * x_hi[None, :, :], axis=2)
            xs_lo += tl.sum(x_lo, axis=1)
            xs_hi += tl.sum(x_hi, axis=1)
        hdr = tl.load(blk, mask=n_mask, other=0)
        d, dmin = _fp16_bits(hdr), _fp16_bits(hdr >> 16)
        sc_w = tl.load(blk + 1, mask=n_mask, other=0)[:, None]  # scale bytes of sub-blocks 0..3
        mn_w = tl.load(blk + 2, mask=n_mask, other=0)[:, None]  # min bytes of sub-blocks 0..3
        lo_w = tl.load(blk + 3, mask=n_mask, other=0)[:, None]  # low 4 bits of 4..7's
        acc_blk = tl.zeros([BLOCK_N], tl.float32)
        mins_blk = tl.zeros([BLOCK_N], tl.float32)
        for odd in tl.static_range(2):
            jj = jj_odd if odd else jj_even
            sc = (sc_w >> (8 * jj[None, :])) & 255
            mn = (mn_w >> (8 * jj[None, :])) & 255
            low = (lo_w >> (8 * jj[None, :])) & 255
            scale = tl.where(first_half[None, :], sc & 63, (low & 15) | ((sc >> 2) & 48)).to(tl.float32)
            mins = tl.where(first_half[None, :], mn & 63, (low >> 4) | ((mn >> 2) & 48)).to(tl.float32)
            if odd:
                acc_blk += tl.sum(scale * s_hi, axis=1)
                mins_blk += tl.sum(mins * xs_hi[None, :], axis=1)
            else:
                acc_blk += tl.sum(scale * s_lo, axis=1)
                mins_blk += tl.sum(mins * xs_lo[None, :], axis=1)
        acc += d * acc_blk - dmin * mins_blk
    tl.store(out_ptr + t * out_stride + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _q6k_word_kernel(x_ptr, w_ptr, out_ptr, N, K, x_stride, out_stride, row_halves, BLOCK_N: tl.constexpr):
    t = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    s = tl.arange(0, 4)  # s = 2n + (l // 16): the half n and which 16 of the 32 lanes l
    i = tl.arange(0, 8)
    half = s // 2
    lane = 8 * (s % 2)[:, None] + i[None, :]  # [4, 8]: the 16-bit word within a 32-byte run
    ql_words = (32 * half[:, None] + lane)[None, :, :]
    qh_words = (64 + 16 * half[:, None] + lane)[None, :, :]
    xoff = 128 * half[:, None] + 2 * lane  # value of byte 0 of each word at g = 0
    rows = w_ptr + offs_n.to(tl.int64) * row_halves
    mask3 = n_mask[:, None, None]
    xrow = x_ptr + t * x_stride
    acc = tl.zeros([BLOCK_N], tl.float32)
    for sb in range(0, K // 256):
        blk = rows + sb * 105
        base = blk[:, None, None]
        ql_a = tl.load(base + ql_words, mask=mask3, other=0).to(tl.int32) & 0xFFFF  # g = 0, 2
        ql_b = tl.load(base + ql_words + 16, mask=mask3, other=0).to(tl.int32) & 0xFFFF  # g = 1, 3
        qh = tl.load(base + qh_words, mask=mask3, other=0).to(tl.int32) & 0xFFFF
        xb = xrow + sb * 256 + xoff
        acc_blk = tl.zeros([BLOCK_N], tl.float32)
        for g in tl.static_range(4):
            ql = ql_b if g % 2 else ql_a
            sums = tl.zeros([BLOCK_N, 4], tl.float32)
            for b in tl.static_range(2):
                x = tl.load(xb + 32 * g + b).to(tl.float32)
                low = (ql >> (8 * b + 4 * (g // 2))) & 15
                high = (qh >> (8 * b + 2 * g)) & 3
                sums += tl.sum(((low | (high << 4)) - 32).to(tl.float32) * x[None, :, :], axis=2)
            # scale of (g, s): byte 192 + 8 (s // 2) + 2g + s % 2, i.e. byte s % 2 of word
            # 96 + 4 (s // 2) + g
            sw = tl.load(blk[:, None] + (96 + 4 * half + g)[None, :], mask=n_mask[:, None], other=0).to(tl.int32)
            sc = (sw >> (8 * (s % 2))[None, :]) & 255
            scale = tl.where(sc >= 128, sc - 256, sc).to(tl.float32)
            acc_blk += tl.sum(scale * sums, axis=1)
        d = _fp16_bits(tl.load(blk + 104, mask=n_mask, other=0).to(tl.int32))
        acc += d * acc_blk
    tl.store(out_ptr + t * out_stride + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


def word_matmul(x: torch.Tensor, qweight: torch.Tensor, qtype: str, K: int, block_n: int,
                num_warps: int) -> torch.Tensor:
    """x [T, K] @ W^T for Q4_K / Q6_K `qweight` (checked by gguf.gguf_matmul), one program per
    `block_n` rows and token row."""
    T, N = x.shape[0], qweight.shape[0]
    out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, block_n), T)
    if qtype == "Q4_K":
        words = qweight.view(torch.int32)  # 144-byte blocks: whole 32-bit words
        _q4k_word_kernel[grid](x, words, out, N, K, x.stride(0), out.stride(0), words.shape[1],
                               BLOCK_N=block_n, num_warps=num_warps)
    elif qtype == "Q6_K":
        halves = qweight.view(torch.int16)  # 210-byte blocks: whole 16-bit words only
        _q6k_word_kernel[grid](x, halves, out, N, K, x.stride(0), out.stride(0), halves.shape[1],
                               BLOCK_N=block_n, num_warps=num_warps)
    else:
        raise ValueError(f"word kernels take {WORD_TYPES}, not {qtype!r}")
    return out
