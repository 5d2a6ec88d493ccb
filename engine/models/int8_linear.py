"""W8A8 projections (compressed-tensors int8 weights with dynamic per-token int8 activations):
int8 weights with one fp32 scale per output row, each product an integer GEMM.

Per call, each activation row is rounded to int8 steps of max|x_row| / 127 (vLLM's dynamic
per-token scheme), multiplied by the int8 weight in int32 (torch._int_mm: exact, no rounding
until the two scales are applied), and scaled back in fp32. The int8 rounding of the
activations is the scheme's, not ours: the result is x_q @ W^T, x_q the rounded rows, so
tokens may differ from the dense fp32 model's (and from an implementation that rounds with
another step) where two logits nearly tie.

Same interface as engine.models.quant_linear.QuantWeight (what the loader fills and the
linear layers call); `qtype` "int8" has no GGUF kernel, so the one-call decode stack leaves
these models to the layer-by-layer path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.models.quant_linear import rows_covered

QTYPE = "int8"


@dataclass
class Int8Segment:
    start: int
    stop: int
    # int8 [stop - start, in_features], row-major: its transpose (a column-major view) is
    # _int_mm's right operand. Measured against a contiguous W^T (2 threads, K = 2048,
    # N = 5632): at one row 0.12 against 5-10 ms (a dot-product path), even from 4 rows up.
    weight: torch.Tensor
    scale: torch.Tensor  # fp32 [stop - start]: per output row
    qtype: str = QTYPE
    perm = None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x fp32 [T, K] -> (int8 [T, K], fp32 [T] step): each row rounded to steps of max|x| / 127."""
    step = x.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    return torch.round(x / step[:, None]).clamp_(-127, 127).to(torch.int8), step


@dataclass
class Int8Weight:
    """An [out_features, in_features] int8 weight with per-row scales, in row segments."""

    out_features: int
    in_features: int
    segments: list[Int8Segment] = field(default_factory=list)

    def add(self, start: int, stop: int, weight: torch.Tensor, scale: torch.Tensor) -> None:
        if weight.dtype != torch.int8 or weight.shape != (stop - start, self.in_features):
            raise ValueError(f"int8 rows [{start}, {stop}) need int8 [{stop - start}, {self.in_features}], "
                             f"got {weight.dtype} {tuple(weight.shape)}")
        scale = scale.reshape(-1).float()
        if scale.shape != (stop - start,):
            raise ValueError(f"int8 rows [{start}, {stop}) need {stop - start} scales, got {tuple(scale.shape)}")
        self.segments.append(Int8Segment(start, stop, weight.contiguous(), scale.contiguous()))
        self.segments.sort(key=lambda s: s.start)
        if len(self.segments) > 1 and self.covered():
            # One GEMM per call for a fused projection (q, k, v share the rounded activations).
            self.segments = [Int8Segment(0, self.out_features, torch.cat([s.weight for s in self.segments]),
                                         torch.cat([s.scale for s in self.segments]))]

    def covered(self) -> bool:
        return rows_covered(self.segments, self.out_features)

    @property
    def nbytes(self) -> int:
        return sum(s.weight.numel() + 4 * s.scale.numel() for s in self.segments)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features] fp32 (then x's dtype)."""
        flat = x.reshape(-1, self.in_features).float()
        xq, step = quantize_rows(flat)
        parts = [torch._int_mm(xq, s.weight.T).float() * s.scale for s in self.segments]
        out = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)) * step[:, None]
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The dense fp32 weight [out_features, in_features]."""
        return torch.cat([s.weight.float() * s.scale[:, None] for s in self.segments], dim=0)
