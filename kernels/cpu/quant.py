"""Products with GGUF-quantized weights kept in their block format (C: kernels/cpu/quant.c).

Contract:

    quant_matmul(x: torch.Tensor [T, K] float32 (rows contiguous), qweight: torch.Tensor uint8
                 [N, row_bytes] contiguous, qtype: str, K: int, out: torch.Tensor | None = None,
                 method: str = "auto") -> [T, N] float32
        y = x @ W^T where row n of W is the dequantization (exactly as
        engine.models.gguf_quants.dequantize) of qweight[n]: K values, K / block_values blocks
        of the GGUF layout. `out` (fp32 [T, N], rows contiguous, any row stride) is written
        and returned.
    quant_embedding(ids: torch.Tensor [T] int64, qweight, qtype, K) -> [T, K] float32
        rows ids of W, dequantized exactly (an embedding table looked up without expanding it).
    supported(qtype, K) -> bool
        whether the C path takes this type and row length; the caller falls back to a
        dequantized fp32 weight otherwise (quant_matmul raises ValueError for those, naming
        the problem, as for a non-contiguous or wrong-sized qweight).

Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (K a multiple of 32) and Q4_K, Q5_K, Q6_K (K a multiple
of 256). Two methods:
  "int8": each activation row is rounded per 32 values to int8 steps of
          max|x| / 127 (once per call), then integer dot products with the weights' integer
          values (AVX-512 VNNI / AVX-VNNI / AVX2 / plain C) are scaled per block in fp32, as
          llama.cpp does. y is then x_q @ W^T up to fp32 rounding, x_q the rounded rows: each
          output is within (step / 2) @ |W|^T of the exact product (step per 32 values),
          in practice about 1e-3 of |x| @ |W|^T.
  "fp32": each weight chunk is dequantized exactly and multiplied with FMA: x @ W^T up to
          fp32 summation order. Slower (1.3x to 7x) but exact weights.
From GEMM_ROWS activation rows on, "fp32" dequantizes GEMM_BLOCK weight rows at a time
(exactly, as quant_embedding) and multiplies each block with torch's GEMM: a prefill chunk is
compute-bound, and MKL's GEMM on a dequantized block beats the tile kernel 2-3x there (T = 256
to 512) while costing one block of fp32 memory, not the whole weight.
"auto" is fp32 unless PDSERVE_QUANT_ACTIVATIONS=int8 (see ACTIVATIONS below); int8 measured
faster for every type, shape and T tried (1 to 128, docs/kernels.md#gguf-weights-kept-quantized).
Both stream the weights once per call whatever
T is (T rows share each decoded chunk) and split the output rows over
torch.get_num_threads() OpenMP threads.
"""

from __future__ import annotations

import os

import torch

from kernels.cpu.build import library

# qtype -> (code in quant.c, values per block, bytes per block)
QTYPES = {
    "Q4_0": (0, 32, 18), "Q4_1": (1, 32, 20), "Q5_0": (2, 32, 22), "Q5_1": (3, 32, 24),
    "Q8_0": (4, 32, 34), "Q4_K": (5, 256, 144), "Q5_K": (6, 256, 176), "Q6_K": (7, 256, 210),
}
# What "auto" (the engine's choice) means. fp32 by default: the weights exactly, so a kept model
# answers as its dequantized self (and transformers) does; a 135M model's answers move with
# int8 activations (SmolLM2 on "What is the capital of France?" stops saying Paris, as
# llama.cpp's does). PDSERVE_QUANT_ACTIVATIONS=int8 takes llama.cpp's scheme and its tokens,
# 2-7x faster per call at T = 1 (docs/kernels.md#gguf-weights-kept-quantized).
ACTIVATIONS = os.environ.get("PDSERVE_QUANT_ACTIVATIONS", "fp32")
METHODS = {"int8": 0, "fp32": 1, "auto": 0 if ACTIVATIONS == "int8" else 1}
# Measured (docs/kernels.md#gguf-weights-kept-quantized): at 64 rows the two are even, from
# 256 the GEMM is 2-3x faster (SmolLM2's and a 1B model's projections, 2 threads).
GEMM_ROWS = 128
GEMM_BLOCK = 512  # weight rows per dequantized block: 4 MB of fp32 at K = 2048
_F32, _U8 = torch.float32, torch.uint8


def supported(qtype: str, K: int) -> bool:
    """Whether quant_matmul / quant_embedding run `qtype` rows of K values (and the C kernels
    are built)."""
    if qtype not in QTYPES or K <= 0 or K % QTYPES[qtype][1]:
        return False
    return library() is not None


def row_bytes(qtype: str, K: int) -> int:
    _, values, nbytes = QTYPES[qtype]
    return K // values * nbytes


def _check_weight(qweight: torch.Tensor, qtype: str, K: int) -> None:
    if qtype not in QTYPES:
        raise ValueError(f"quantization type {qtype!r} has no C kernel; supported: {list(QTYPES)}")
    if K <= 0 or K % QTYPES[qtype][1]:
        raise ValueError(f"K={K} is not a whole number of {qtype} blocks of {QTYPES[qtype][1]} values")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.device.type != "cpu":
        raise ValueError(f"qweight must be a 2-D uint8 CPU tensor, got {qweight.dtype} "
                         f"{tuple(qweight.shape)} on {qweight.device}")
    if not qweight.is_contiguous():
        raise ValueError(f"qweight must be contiguous (strides {qweight.stride()})")
    if qweight.shape[1] != row_bytes(qtype, K):
        raise ValueError(f"qweight rows are {qweight.shape[1]} bytes; {K} {qtype} values take "
                         f"{row_bytes(qtype, K)}")
    if library() is None:
        raise RuntimeError("the native CPU kernels are not available (check supported() first)")


def _check_matmul(x: torch.Tensor, qweight: torch.Tensor, qtype: str, K: int, out, method: str) -> None:
    """Raises the error naming what is wrong with quant_matmul's arguments."""
    _check_weight(qweight, qtype, K)
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != K or x.device.type != "cpu":
        raise ValueError(f"x must be fp32 [T, {K}] on CPU, got {x.dtype} {tuple(x.shape)} on {x.device}")
    if x.stride(1) != 1:
        raise ValueError(f"x rows must be contiguous (strides {x.stride()})")
    T, N = x.shape[0], qweight.shape[0]
    if out is not None and (out.dtype != torch.float32 or tuple(out.shape) != (T, N) or out.stride(1) != 1
                            or out.device.type != "cpu"):
        raise ValueError(f"out must be fp32 [{T}, {N}] with contiguous rows, got {out.dtype} "
                         f"{tuple(out.shape)} strides {out.stride()}")
    raise ValueError(f"method must be 'auto', 'int8' or 'fp32', got {method!r}")


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, qtype: str, K: int,
                 out: torch.Tensor | None = None, method: str = "auto") -> torch.Tensor:
    """x [T, K] fp32 @ W^T -> [T, N] fp32, W the dequantized qweight (module docstring)."""
    info = QTYPES.get(qtype)
    lib = library()
    T, N = x.shape[0], qweight.shape[0]
    # One combined test on the hot path (decode calls this per projection); the slow path
    # names the problem.
    if (info is None or lib is None or method not in METHODS or x.dtype != _F32 or qweight.dtype != _U8
            or x.dim() != 2 or qweight.dim() != 2 or x.shape[1] != K or K <= 0 or K % info[1]
            or qweight.shape[1] != K // info[1] * info[2] or x.stride(1) != 1 or not qweight.is_contiguous()
            or not x.is_cpu or not qweight.is_cpu
            or (out is not None and (out.dtype != _F32 or out.shape != (T, N) or out.stride(1) != 1
                                     or not out.is_cpu))):
        _check_matmul(x, qweight, qtype, K, out, method)
    if out is None:
        out = torch.empty((T, N), dtype=_F32)
    if T >= GEMM_ROWS and METHODS[method] == 1:
        block = torch.empty((min(N, GEMM_BLOCK), K), dtype=_F32)
        for r0 in range(0, N, GEMM_BLOCK):
            rows = torch.arange(r0, min(N, r0 + GEMM_BLOCK))
            w = block[:len(rows)]
            lib.quant_embedding_f32(rows.data_ptr(), len(rows), qweight.data_ptr(), qweight.shape[1], info[0], K,
                                    w.data_ptr(), torch.get_num_threads())
            out[:, r0:r0 + len(rows)] = x @ w.T
    elif T and N:
        lib.quant_matmul_f32(x.data_ptr(), x.stride(0), qweight.data_ptr(), N, qweight.shape[1], info[0], K,
                             out.data_ptr(), out.stride(0), T, METHODS[method], torch.get_num_threads())
    return out


def quant_embedding(ids: torch.Tensor, qweight: torch.Tensor, qtype: str, K: int) -> torch.Tensor:
    """Rows `ids` of the dequantized qweight: [T, K] fp32, equal to dequantize(qweight)[ids]."""
    _check_weight(qweight, qtype, K)
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise ValueError(f"ids must be a 1-D int64 tensor, got {ids.dtype} {tuple(ids.shape)}")
    ids = ids.contiguous()
    N = qweight.shape[0]
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= N):
        raise ValueError(f"ids must be in [0, {N}), got values in [{int(ids.min())}, {int(ids.max())}]")
    out = torch.empty((len(ids), K), dtype=_F32)
    if len(ids):
        library().quant_embedding_f32(ids.data_ptr(), len(ids), qweight.data_ptr(), qweight.shape[1],
                                      QTYPES[qtype][0], K, out.data_ptr(), torch.get_num_threads())
    return out
