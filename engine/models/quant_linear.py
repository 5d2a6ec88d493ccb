"""Linear methods (vLLM's quantization-method seam; our code): how a projection holds its
weight and multiplies by it.

- dense, the default: an fp32/bf16 `weight` parameter (oneDNN-packed on CPU,
  engine.models.cpu_linear);
- gguf: the weight stays in GGUF blocks (a GGUF file's, or a GPTQ/AWQ/compressed-tensors int4
  or int8 checkpoint's repacked into them exactly at load, engine.models.hf_quant_unpack). A projection is a stack of row segments,
  each of one block type, because a fused projection may mix them (a Q4_K_M file stores attn_v
  in Q6_K beside Q4_K q and k). Each segment is multiplied by a kernel that reads the blocks
  (kernels.cpu.quant on CPU), so a step reads the file's bytes, not 4-8x as many fp32 ones.

Which tensors stay quantized is decided before the model is materialised (the loader's plan):
a whole projection or none, and only block types a kernel takes; the rest are dequantized at
load as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from engine.models.gguf_quants import dequantize


def _kernels():
    from kernels.cpu import quant

    return quant


# CUDA: the Triton kernels (kernels.triton_kernels.gguf) hold a third of the bf16 bytes but,
# timed on an H200, only Q4_K at one token row beats the dense bf16 product, and a kept
# 1B-shaped file decoded 3x slower with the first tilings (docs/kernels.md#gguf-weights-on-a-gpu):
# a GPU dequantizes at load unless this opts in.
TRITON_GGUF = os.environ.get("PDSERVE_GGUF_TRITON", "0") == "1"


def _triton():
    from kernels.triton_kernels import gguf

    return gguf


def kernel_supports(qtype: str, in_features: int, device: torch.device) -> bool:
    """Whether a kernel multiplies `qtype` blocks of rows of `in_features` on `device`."""
    if device.type == "cuda":
        return (TRITON_GGUF and qtype in _triton().QTYPES
                and in_features % _triton().QTYPES[qtype][1] == 0)
    if device.type != "cpu":
        return False
    return _kernels().supported(qtype, in_features)


# ISA levels at which a GGUF file is dequantized at load unless quantization="gguf" asks to keep
# it: with portable's plain-C products, kept blocks decoded 1.6-2.5x slower than the dequantized
# path at batch 1, 8 and 32 (docs/benchmarks.md#kept-blocks-or-dequantized). At the other levels
# kept blocks with exact products were 3.2-3.5x faster at batch 1, 1.5x at 8 and level within
# the noise at 32, in 0.4x the memory, so they are the rule there, with no timing at load (on a shared machine a few ms of timing measure the neighbours).
# aarch64's neon levels have the same kinds of product paths and follow the same rule, untimed
# (no ARM machine has run them); its portable level, plain C, dequantizes as on x86.
DEQUANTIZE_LEVELS = ("portable",)


def free_memory_bytes() -> int:
    """Physical memory not in use now (what a dequantized copy could take without swapping)."""
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def weights_choice(device: torch.device, quantization: str | None, dense_bytes: int) -> tuple[bool, str]:
    """(keep the blocks, why) for a GGUF file's projections that a kernel multiplies, given
    what their dequantized fp32 weights would take; `why` is the loader's log line.

    Both choices made here multiply the exact weights, so the default keeps greedy parity with
    transformers; int8 activations change tokens, so only PDSERVE_QUANT_ACTIVATIONS=int8 takes
    them, and quantization="gguf" / "none" (the loader never asks for "none") override."""
    if device.type != "cpu":
        return True, "multiplied by the Triton kernels (PDSERVE_GGUF_TRITON=1)"
    from kernels.cpu.build import level_in_use

    quant = _kernels()
    if quant.METHODS["auto"] == quant.METHODS["int8"]:
        return True, "int8 activations (PDSERVE_QUANT_ACTIVATIONS=int8: llama.cpp's scheme; tokens may differ)"
    level = level_in_use()
    if quantization is None and level in DEQUANTIZE_LEVELS:
        free = free_memory_bytes()
        if dense_bytes <= free // 2:
            return False, (f"dequantized to fp32 at load (the default at the {level} ISA level, whose "
                           "kept-block products decode slower at every batch size; quantization=gguf keeps them)")
        reason = (f"the default at the {level} ISA level would dequantize, but {dense_bytes / 2**30:.1f} GiB "
                  f"of fp32 weights is over half the free {free / 2**30:.1f} GiB")
    else:
        reason = "quantization=gguf" if quantization == "gguf" else f"the default at the {level} ISA level"
    return True, (f"exact fp32 products ({reason}; quantization=none dequantizes, "
                  "PDSERVE_QUANT_ACTIVATIONS=int8 takes int8 activations)")



def rows_covered(segments, out_features: int) -> bool:
    """Every output row is filled exactly once by segments sorted by start (each has start, stop)."""
    at = 0
    for s in segments:
        if s.start != at:
            return False
        at = s.stop
    return at == out_features

@dataclass
class QuantSegment:
    start: int  # first output row of the projection it fills
    stop: int
    qtype: str
    data: torch.Tensor  # uint8 [stop - start, row bytes], the rows' blocks as the file stores them
    # int64 [in_features]: the input columns in block order (a GPTQ act-order checkpoint's
    # groups sorted, engine.models.hf_quant_unpack); None: the natural order.
    perm: torch.Tensor | None = None


@dataclass
class QuantWeight:
    """An [out_features, in_features] weight kept as GGUF blocks, in row segments."""

    out_features: int
    in_features: int
    segments: list[QuantSegment] = field(default_factory=list)
    device: torch.device | None = None  # where the blocks live (None: where they are read, CPU)

    def add(self, start: int, stop: int, qtype: str, data: torch.Tensor, perm: torch.Tensor | None = None) -> None:
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[0] != stop - start:
            raise ValueError(f"quantized rows [{start}, {stop}) need uint8 [{stop - start}, row bytes], "
                             f"got {data.dtype} {tuple(data.shape)}")
        data = data.contiguous() if self.device is None else data.to(self.device).contiguous()
        if perm is not None and (self.device is not None and self.device.type != "cpu" or perm.shape != (self.in_features,)):
            raise ValueError(f"a column order is {self.in_features} indices on CPU, got {tuple(perm.shape)}")
        self.segments.append(QuantSegment(start, stop, qtype, data, perm))
        self.segments.sort(key=lambda s: s.start)

    def covered(self) -> bool:
        return rows_covered(self.segments, self.out_features)

    @property
    def nbytes(self) -> int:
        return sum(s.data.numel() for s in self.segments)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] @ W^T -> [..., out_features] in fp32 (the kernels' dtype)."""
        flat = x.reshape(-1, self.in_features)
        if flat.device.type == "cpu":
            flat = flat.float().contiguous()
            quant = _kernels()
            parts = [quant.quant_matmul(flat if s.perm is None else flat[:, s.perm], s.data, s.qtype, self.in_features)
                     for s in self.segments]
        else:
            parts = self.triton_parts(flat.contiguous())
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def triton_parts(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each segment's product in flat's dtype by the Triton kernel (the GPU path; tests run
        it on CPU under TRITON_INTERPRET=1)."""
        gguf = _triton()
        return [gguf.gguf_matmul(flat, s.data, s.qtype, self.in_features) for s in self.segments]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W (an embedding table), dequantized: [len(ids), in_features] fp32."""
        if len(self.segments) != 1:
            raise ValueError("an embedding table is one segment")
        s = self.segments[0]
        if s.data.device.type != "cpu":  # the looked-up rows' blocks, dequantized by torch ops
            rows = s.data[ids.reshape(-1)]
            return dequantize(rows.reshape(-1), s.qtype, (rows.shape[0], self.in_features))
        return _kernels().quant_embedding(ids.reshape(-1), s.data, s.qtype, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The dense fp32 weight (tests, and the reference the kernels are held to)."""
        rows = []
        for s in self.segments:
            w = dequantize(s.data.reshape(-1), s.qtype, (s.stop - s.start, self.in_features))
            if s.perm is not None:
                w = torch.empty_like(w).index_copy_(1, s.perm, w)  # back to the natural column order
            rows.append(w)
        return torch.cat(rows, dim=0)
