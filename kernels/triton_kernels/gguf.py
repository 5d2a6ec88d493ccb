"""Products with GGUF-quantized weights kept in their block format, for CUDA (Triton; on CPU
only under TRITON_INTERPRET=1, as the tests run it). The CPU counterpart is kernels.cpu.quant.

Contract:

    gguf_matmul(x [T, K] fp32/fp16/bf16 (rows contiguous), qweight uint8 [N, row_bytes]
                contiguous, qtype, K) -> [T, N] in x's dtype
        x @ W^T, W the dequantization of qweight's rows exactly as
        engine.models.gguf_quants.dequantize computes it (fp32), rounded to x's dtype before
        the product when x is 16-bit (so the product equals the dequantize-at-load path of a
        16-bit model, whose weights are that rounding), accumulated in fp32.
    SUPPORTED: the types it takes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: K a multiple of 32; Q4_K, Q5_K,
        Q6_K: K a multiple of 256).

Each program dequantizes a [BLOCK_N, BLOCK_K] tile of W in registers (every value's bytes are
found by the ggml layout formulas below) and multiplies it into a [BLOCK_T, BLOCK_N] fp32
tile with tl.dot; weights are read once per token tile, never written back dequantized. The
launch reads no device data (the grid comes from shapes), so it can be captured in a CUDA
graph.

Value v of a block (v < 32, or < 256 for the K-quants), per type, with b the block's bytes:
  Q4_0: d = f16(b[0:2]); q = nibble v of b[2:18] (byte v % 16, high half for v >= 16); d (q - 8)
  Q4_1: d, m = f16(b[0:2]), f16(b[2:4]); nibbles at b[4:20]; d q + m
  Q5_0: d; fifth bits b[2:6] (bit v); nibbles at b[6:22]; d (q - 16)
  Q5_1: d, m; fifth bits b[4:8]; nibbles at b[8:24]; d q + m
  Q8_0: d; q = int8 b[2 + v]; d q
  Q4_K: d, dmin = f16(b[0:2]), f16(b[2:4]); sub-block j = v / 32 has a 6-bit scale and min
        from b[4:16]; q = nibble (v / 32) % 2 of byte 16 + 32 (v / 64) + v % 32;
        (d scale) q - dmin min
  Q5_K: as Q4_K with nibbles from byte 48 + ..., and the fifth bit v / 32 of byte 16 + v % 32
  Q6_K: low nibble (v % 128) / 64 of byte 64 (v / 128) + v % 64, high 2 bits
        (v % 128) / 32 of byte 128 + 32 (v / 128) + v % 32; int8 scale b[192 + v / 16];
        d = f16(b[208:210]); (d scale) (q - 32)
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# qtype -> (code in the kernel, values per block, bytes per block); the CPU kernels' codes.
QTYPES = {
    "Q4_0": (0, 32, 18), "Q4_1": (1, 32, 20), "Q5_0": (2, 32, 22), "Q5_1": (3, 32, 24),
    "Q8_0": (4, 32, 34), "Q4_K": (5, 256, 144), "Q5_K": (6, 256, 176), "Q6_K": (7, 256, 210),
}
SUPPORTED = tuple(QTYPES)


@triton.jit
def _u8(p, mask):
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(p, mask):
    """The little-endian fp16 at p (bytes p, p + 1), as fp32."""
    bits = _u8(p, mask) | (_u8(p + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_scale_min(b, j, mask):
    """Q4_K/Q5_K's 6-bit scale and min of sub-block j (0..7) from the 12 bytes at b + 4."""
    lo = j < 4
    jj = tl.where(lo, j, j - 4)
    sc = _u8(b + 4 + jj, mask)  # scales 0..3, or the top 2 bits of 4..7
    mn = _u8(b + 8 + jj, mask)  # mins 0..3, or the top 2 bits of 4..7
    low = _u8(b + 12 + jj, mask)  # low 4 bits of scales / mins 4..7
    scale = tl.where(lo, sc & 63, (low & 15) | ((sc >> 2) & 48))
    mins = tl.where(lo, mn & 63, (low >> 4) | ((mn >> 2) & 48))
    return scale.to(tl.float32), mins.to(tl.float32)


@triton.jit
def _weights(w_ptr, offs_n, offs_k, mask, row_bytes, QTYPE: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr):
    """W[offs_n, offs_k] as fp32 [BN, BK], dequantized as engine.models.gguf_quants does
    (QK values in blocks of BB bytes)."""
    v = (offs_k % QK)[None, :]
    b = w_ptr + offs_n[:, None].to(tl.int64) * row_bytes + (offs_k // QK)[None, :] * BB
    if QTYPE < 4:  # 4- and 5-bit 32-value blocks: nibble v % 16 of the quants, high half from 16
        qs: tl.constexpr = 2 + 2 * QTYPE  # the quants' first byte
        q = (_u8(b + qs + v % 16, mask) >> ((v // 16) * 4)) & 15
        if QTYPE == 2 or QTYPE == 3:
            q = q | (((_u8(b + qs - 4 + v // 8, mask) >> (v % 8)) & 1) << 4)
        d = _f16(b, mask)
        if QTYPE == 0:
            w = d * (q.to(tl.float32) - 8.0)
        elif QTYPE == 2:
            w = d * (q.to(tl.float32) - 16.0)
        else:
            w = d * q.to(tl.float32) + _f16(b + 2, mask)
    elif QTYPE == 4:
        q = tl.load(b + 2 + v, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = _f16(b, mask) * q
    elif QTYPE == 5 or QTYPE == 6:
        base: tl.constexpr = 16 + 32 * (QTYPE - 5)  # Q4_K's nibbles at 16, Q5_K's at 48
        q = (_u8(b + base + 32 * (v // 64) + v % 32, mask) >> (((v // 32) % 2) * 4)) & 15
        if QTYPE == 6:
            q = q | (((_u8(b + 16 + v % 32, mask) >> (v // 32)) & 1) << 4)
        scale, mins = _k_scale_min(b, v // 32, mask)
        w = _f16(b, mask) * scale * q.to(tl.float32) - _f16(b + 2, mask) * mins
    else:
        r = v % 128
        low = (_u8(b + 64 * (v // 128) + v % 64, mask) >> ((r // 64) * 4)) & 15
        high = (_u8(b + 128 + 32 * (v // 128) + v % 32, mask) >> ((r // 32) * 2)) & 3
        scale = tl.load(b + 192 + v // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = _f16(b + 208, mask) * scale * ((low | (high << 4)).to(tl.float32) - 32.0)
    return w


@triton.jit
def _gguf_matmul_kernel(
    x_ptr, w_ptr, out_ptr, T, N, K, x_stride, out_stride, row_bytes,
    QTYPE: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_mask, n_mask = offs_t < T, offs_n < N
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_t[:, None] * x_stride + offs_k[None, :], mask=t_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [BT, BK]
        w = _weights(w_ptr, offs_n, offs_k, n_mask[:, None] & k_mask[None, :], row_bytes, QTYPE, QK, BB)  # [BN, BK]
        w = w.to(x_ptr.dtype.element_ty)  # a 16-bit model's weights are this rounding
        if UPCAST:  # the interpreter's dot has no 16-bit math; fp32 wants exact (not tf32) products
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:  # 16-bit x 16-bit: exact products, fp32 accumulation, tensor cores
            acc += tl.dot(x, tl.trans(w))
    tl.store(out_ptr + offs_t[:, None] * out_stride + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_mask[:, None] & n_mask[None, :])


def _check(x: torch.Tensor, qweight: torch.Tensor, qtype: str, K: int) -> None:
    if qtype not in QTYPES:
        raise ValueError(f"quantization type {qtype!r} has no Triton kernel; supported: {list(QTYPES)}")
    _, values, nbytes = QTYPES[qtype]
    if K <= 0 or K % values:
        raise ValueError(f"K={K} is not a whole number of {qtype} blocks of {values} values")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or not qweight.is_contiguous():
        raise ValueError(f"qweight must be a contiguous 2-D uint8 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    if qweight.shape[1] != K // values * nbytes:
        raise ValueError(f"qweight rows are {qweight.shape[1]} bytes; {K} {qtype} values take {K // values * nbytes}")
    if (x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or x.dim() != 2 or x.shape[1] != K
            or x.stride(1) != 1 or x.device != qweight.device):
        raise ValueError(f"x must be [T, {K}] fp32/fp16/bf16 with contiguous rows on {qweight.device}, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()} on {x.device}")


def gguf_matmul(x: torch.Tensor, qweight: torch.Tensor, qtype: str, K: int) -> torch.Tensor:
    """x [T, K] @ W^T -> [T, N] in x's dtype, W the dequantized qweight (module docstring)."""
    _check(x, qweight, qtype, K)
    T, N = x.shape[0], qweight.shape[0]
    out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T == 0 or N == 0:
        return out
    # tl.dot's smallest tile is 16; a decode step's few rows take one 16-row tile, a prefill 64.
    bt = 16 if _INTERPRET or T <= 16 else 64
    bn = 32 if _INTERPRET else 64
    upcast = _INTERPRET or x.dtype == torch.float32
    grid = (triton.cdiv(T, bt), triton.cdiv(N, bn))
    _gguf_matmul_kernel[grid](x, qweight, out, T, N, K, x.stride(0), out.stride(0), qweight.shape[1],
                              QTYPE=QTYPES[qtype][0], QK=QTYPES[qtype][1], BB=QTYPES[qtype][2], BLOCK_T=bt, BLOCK_N=bn, BLOCK_K=32, UPCAST=upcast)
    return out
