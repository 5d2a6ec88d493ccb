"""Products with a weight held as 16-bit floats (C: kernels/cpu/half_matmul.c).

A quantized checkpoint's tensors that stay unquantized (the LM head, a tied embedding table)
are stored in fp16 or bf16; held in fp32 they are read at twice their bytes every step, which
at batch-1 decode is the time. Here they stay 16-bit and each value is widened exactly.

Contract:

    half_matmul(x: torch.Tensor [T, K] float32 (rows contiguous), weight: torch.Tensor [N, K]
                float16 or bfloat16 (rows contiguous, any row stride), out: torch.Tensor | None
                = None) -> [T, N] float32
        y = x @ weight.float().T (reference: `half_matmul_reference`) up to fp32 summation
        order: the weight's values exactly as the fp32 upcast has them, fp32 products and
        sums. `out` (fp32 [T, N], rows contiguous, any row stride) is written and returned.
        Bad arguments are a ValueError naming the argument.
    supported(weight) -> bool
        whether the C path takes this weight (a 2-D fp16/bf16 CPU tensor, kernels built).

The threads (torch.get_num_threads()) split the output rows. No GEMM path for many rows:
widening blocks of the weight for torch's GEMM was slower than the tiles at every row count
measured (1 to 512 rows, a 32000 x 2048 fp16 head, AVX-512, one thread; docs/kernels.md).
"""

from __future__ import annotations

import torch

from kernels.cpu.build import library

KINDS = {torch.float16: 0, torch.bfloat16: 1}
_F32 = torch.float32


def supported(weight: torch.Tensor) -> bool:
    """Whether half_matmul runs `weight` in C."""
    return (weight.dtype in KINDS and weight.dim() == 2 and weight.device.type == "cpu"
            and library() is not None)


def half_matmul_reference(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The torch expression half_matmul computes: x @ weight.float().T."""
    y = x @ weight.float().T
    return y if out is None else out.copy_(y)


def _check(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> None:
    if weight.dtype not in KINDS or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"weight must be a 2-D float16 or bfloat16 CPU tensor, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    if weight.stride(1) != 1:
        raise ValueError(f"weight rows must be contiguous (strides {weight.stride()})")
    K = weight.shape[1]
    if x.dtype != _F32 or x.dim() != 2 or x.shape[1] != K or x.device.type != "cpu":
        raise ValueError(f"x must be fp32 [T, {K}] on CPU, got {x.dtype} {tuple(x.shape)} on {x.device}")
    if x.stride(1) != 1:
        raise ValueError(f"x rows must be contiguous (strides {x.stride()})")
    T, N = x.shape[0], weight.shape[0]
    if out is not None and (out.dtype != _F32 or tuple(out.shape) != (T, N) or out.stride(1) != 1
                            or out.device.type != "cpu"):
        raise ValueError(f"out must be fp32 [{T}, {N}] with contiguous rows, got {out.dtype} "
                         f"{tuple(out.shape)} strides {out.stride()}")
    if library() is None:
        raise RuntimeError("the native CPU kernels are not available (check supported() first)")


def half_matmul(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] fp32 @ weight.float().T -> [T, N] fp32, weight fp16/bf16 (module docstring)."""
    lib = library()
    kind = KINDS.get(weight.dtype)
    # One combined test on the hot path (every step's logits); the slow path names the problem.
    if (kind is None or lib is None or x.dtype != _F32 or x.dim() != 2 or weight.dim() != 2
            or x.shape[1] != weight.shape[1] or x.stride(1) != 1 or weight.stride(1) != 1
            or not x.is_cpu or not weight.is_cpu
            or (out is not None and (out.dtype != _F32 or out.shape != (x.shape[0], weight.shape[0])
                                     or out.stride(1) != 1 or not out.is_cpu))):
        _check(x, weight, out)
    (T, K), N = x.shape, weight.shape[0]
    if out is None:
        out = torch.empty((T, N), dtype=_F32)
    if T and N:
        lib.half_matmul_f32(x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0), N, K, kind,
                            out.data_ptr(), out.stride(0), T, torch.get_num_threads())
    return out
