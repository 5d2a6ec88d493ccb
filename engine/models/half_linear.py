"""A quantized checkpoint's unquantized head (or tied embedding table) held in its own 16-bit
form.

GPTQ / AWQ / compressed-tensors checkpoints usually leave the LM head unquantized, stored in
fp16 or bf16. Widened to fp32 at load it is the biggest read of a decode step (a 32000 x 2048
head: 262 MB against 131 in fp16), and batch-1 decode is bandwidth. Held as stored, it is
multiplied by kernels.cpu.half (each value widened exactly, fp32 products): the same logits
as transformers' fp32 upcast up to summation order.

Same interface as engine.models.quant_linear.QuantWeight where the loader and the layers use
it (add, covered, nbytes, matmul, embed, dequantize).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.models.quant_linear import rows_covered

DTYPES = (torch.float16, torch.bfloat16)


def _kernels():
    from kernels.cpu import half

    return half


@dataclass
class _Rows:
    start: int
    stop: int


@dataclass
class HalfWeight:
    """An [out_features, in_features] weight kept as fp16 or bf16 on CPU."""

    out_features: int
    in_features: int
    dtype: torch.dtype
    weight: torch.Tensor | None = None  # [out_features, in_features] of `dtype`, at the first add
    _filled: list[_Rows] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"a 16-bit weight is float16 or bfloat16, got {self.dtype}")

    def add(self, start: int, stop: int, rows: torch.Tensor) -> None:
        if rows.dtype != self.dtype or rows.shape != (stop - start, self.in_features):
            raise ValueError(f"rows [{start}, {stop}) need {self.dtype} [{stop - start}, {self.in_features}], "
                             f"got {rows.dtype} {tuple(rows.shape)}")
        if self.weight is None:
            self.weight = torch.empty((self.out_features, self.in_features), dtype=self.dtype)
        self.weight[start:stop] = rows
        self._filled.append(_Rows(start, stop))
        self._filled.sort(key=lambda r: r.start)

    def covered(self) -> bool:
        return rows_covered(self._filled, self.out_features)

    @property
    def nbytes(self) -> int:
        return 0 if self.weight is None else self.weight.numel() * self.weight.element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] @ W^T -> [..., out_features] fp32 (then x's dtype)."""
        flat = x.reshape(-1, self.in_features).float().contiguous()
        out = _kernels().half_matmul(flat, self.weight)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W (an embedding table), widened exactly: [len(ids), in_features] fp32."""
        return self.weight[ids.reshape(-1)].float()

    def dequantize(self) -> torch.Tensor:
        """The dense fp32 weight."""
        return self.weight.float()
