"""fp32 projections on CPU through oneDNN, with each weight packed once after loading.

MKL's sgemm (behind F.linear) re-packs the weight matrix on every call; at decode batch sizes
(one to a few dozen rows) that costs as much as the product itself. oneDNN's linear on a
weight reordered once at load does not. Measured on a 2-core Zen 3 (AVX2), the bench model's
four projections with weights streamed from memory: 88 vs 54 GFLOP/s at 16 rows, 130 vs 102
at 48, 162 vs 155 at 256, and ~6% slower than MKL from 1024 rows up (prefill chunks).

After packing, a layer's dense `weight` is dropped (set to None) so the weights are not held
twice; anything that still reached for it would fail loudly rather than read stale data.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

logger = logging.getLogger(__name__)

# oneDNN picks its packed layout for a batch size; decode batches are the ones that gain.
_BATCH_HINT = 64


def onednn_linear_available() -> bool:
    return (os.environ.get("PDSERVE_ONEDNN_LINEAR", "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed copy of an fp32 CPU [out, in] weight, or None where it does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not onednn_linear_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ W^T + bias with W packed by `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinearMixin:
    """For nn.Linear subclasses: `pack()` swaps the dense weight for a packed one, and
    `linear(x, bias)` is x @ W^T (+ bias) with whichever the layer holds."""

    packed_weight: torch.Tensor | None = None

    def pack(self) -> bool:
        packed = pack_weight(self.weight)
        if packed is None:
            return False
        self.packed_weight = packed
        self.weight = None
        return True

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, bias)
        return nn.functional.linear(x, self.weight, bias)


def pack_model_linears(model: nn.Module) -> int:
    """Pack every projection of `model` that supports it; returns how many were packed."""
    n = sum(1 for m in model.modules() if isinstance(m, PackedLinearMixin) and m.pack())
    if n:
        logger.debug("packed %d linear weights for oneDNN", n)
    return n
