"""Products with GGUF-quantized weights kept in their block format, for CUDA (Triton; on CPU
only under TRITON_INTERPRET=1, as the tests run it). The CPU counterpart is kernels.cpu.quant.

Contract:

    gguf_matmul(x [T, K] fp32/fp16/bf16 (rows contiguous), qweight uint8 [N, row_bytes]
                contiguous, qtype, K) -> [T, N] in x's dtype
        x @ W^T, W the dequantization of qweight's rows exactly as
        engine.models.gguf_quants.dequantize computes it (fp32), rounded to x's dtype before
        the product when x is 16-bit (so the product equals the dequantize-at-load path of a
        16-bit model, whose weights are that rounding), accumulated in fp32. The whole-word
        Q4_K / Q6_K kernels (gguf_words, decode sizes) multiply the unrounded weights: within
        the same bound.
    SUPPORTED: the types it takes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: K a multiple of 32; Q4_K, Q5_K,
        Q6_K: K a multiple of 256).

Each program dequantizes a [BLOCK_N, BLOCK_K] tile of W in registers (every value's bytes are
found by the ggml layout formulas below) and multiplies it into a [BLOCK_T, BLOCK_N] fp32
tile with tl.dot (or, one token row per program, reduces it with tl.sum); weights are read
once per token tile, never written back dequantized. The launches read no device data (the
grid comes from shapes), so they can be captured in a CUDA graph.

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
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton_kernels.gguf_words import word_matmul

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


@triton.jit
def _gguf_gemv_kernel(
    x_ptr, w_ptr, out_ptr, N, K, x_stride, out_stride, row_bytes,
    QTYPE: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One token row per program (grid: N tiles x T): no 16-row dot tile to pad at decode
    sizes. Products in fp32 of the weights rounded to x's dtype, as the dot kernel."""
    t = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + t * x_stride + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        w = _weights(w_ptr, offs_n, offs_k, n_mask[:, None] & k_mask[None, :], row_bytes, QTYPE, QK, BB)
        w = w.to(x_ptr.dtype.element_ty).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + t * out_stride + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@dataclass(frozen=True)
class Tiles:
    """A launch's tiling. method "dot": BLOCK_T rows share each dequantized [BLOCK_N, BLOCK_K]
    weight tile through tl.dot; "gemv": one token row per program (tl.sum, no 16-row dot tile);
    "words": the whole-word kernels of gguf_words (Q4_K, Q6_K; block_k unused)."""

    method: str
    block_n: int
    block_k: int = 32
    block_t: int = 16
    num_warps: int = 4


# Launch choices timed on an H200 (bf16, 1B and 7B projection shapes; scripts/bench_kernels.py
# --only tiles at 1, 4 and 16 rows, docs/kernels.md#gguf-weights-on-a-gpu): the whole-word
# kernels win for Q4_K up to 16 rows and Q6_K up to 4, with one warp each and thin tiles at a
# single row; the general one-row kernel wins for the other types up to 4 rows; past those,
# the dot kernel. Where the launch changes with T, so does the rounding (the word kernels use
# unrounded weights): on this opt-in path a product's last bits depend on the batch's size.
WORDS_MAX_T = {"Q4_K": 16, "Q6_K": 4}
ONE_ROW_MAX_T = 4


def default_tiles(T: int, qtype: str) -> Tiles:
    """The tiling gguf_matmul uses for T token rows of a qtype weight."""
    if T <= WORDS_MAX_T.get(qtype, 0):
        if qtype == "Q4_K":
            return Tiles("words", 8 if T == 1 else 32, num_warps=1)
        return Tiles("words", 2 if T == 1 else 4, num_warps=1)
    if _INTERPRET:  # small tiles: the interpreter's cost grows with the tile
        return Tiles("dot", 32, 32, 16)
    if T <= ONE_ROW_MAX_T:
        return Tiles("gemv", 16, 128, 1, 2)
    return Tiles("dot", 32, 64, 16) if T <= 16 else Tiles("dot", 64, 32, 64)


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


def gguf_matmul(x: torch.Tensor, qweight: torch.Tensor, qtype: str, K: int, tiles: Tiles | None = None) -> torch.Tensor:
    """x [T, K] @ W^T -> [T, N] in x's dtype, W the dequantized qweight (module docstring).
    `tiles`: the launch's tiling (default_tiles; the benchmark sweeps others)."""
    _check(x, qweight, qtype, K)
    T, N = x.shape[0], qweight.shape[0]
    if T == 0 or N == 0:
        return torch.empty((T, N), dtype=x.dtype, device=x.device)
    tiles = tiles or default_tiles(T, qtype)
    code, values, nbytes = QTYPES[qtype]
    if tiles.method not in ("dot", "gemv", "words"):
        raise ValueError(f"tiles.method must be 'dot', 'gemv' or 'words', got {tiles.method!r}")
    if tiles.method == "words":
        return word_matmul(x, qweight, qtype, K, tiles.block_n, tiles.num_warps)
    out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if tiles.method == "gemv":
        grid = (triton.cdiv(N, tiles.block_n), T)
        _gguf_gemv_kernel[grid](x, qweight, out, N, K, x.stride(0), out.stride(0), qweight.shape[1],
                                QTYPE=code, QK=values, BB=nbytes, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                                num_warps=tiles.num_warps)
        return out
    # tl.dot's smallest tile is 16 rows: a decode step's few rows take one 16-row tile.
    upcast = _INTERPRET or x.dtype == torch.float32
    grid = (triton.cdiv(T, tiles.block_t), triton.cdiv(N, tiles.block_n))
    _gguf_matmul_kernel[grid](x, qweight, out, T, N, K, x.stride(0), out.stride(0), qweight.shape[1],
                              QTYPE=code, QK=values, BB=nbytes, BLOCK_T=tiles.block_t, BLOCK_N=tiles.block_n,
                              BLOCK_K=tiles.block_k, UPCAST=upcast, num_warps=tiles.num_warps)
    return out
