"""fp32 projections on CPU through oneDNN, with each weight packed once after loading.

MKL's sgemm (behind F.linear) re-packs the weight matrix on every call; at decode batch sizes
(one to a few dozen rows) that costs as much as the product itself. oneDNN's linear on a
weight reordered once at load does not. Measured on a 2-core Zen 3 (AVX2), the bench model's
four projections with weights streamed from memory: 88 vs 54 GFLOP/s at 16 rows, 130 vs 102
at 48, 162 vs 155 at 256, and ~6% slower than MKL from 1024 rows up (prefill chunks).

After packing, a layer's dense `weight` is dropped (set to None) so the weights are not held
twice; anything that still reached for it would fail loudly rather than read stale data.

oneDNN JIT-compiles a primitive for every input shape it sees and keeps it in two caches
(oneDNN's and ideep's, 1,024 entries each). A served engine's steps have almost any row count
(decode rows plus prefill chunks of any length), so without a bound every new count costs a
compile (~0.3-0.9 ms per projection) and ~0.6-1.9 MB that stays: a replica grew by 0.5 GB over
3,000 requests. Rows are therefore padded up to a ladder of sizes (`row_bucket`), which bounds
the shapes to about 8 per doubling of the row count.
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


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# Row counts up to here run at their own shape: decode batches, the commonest steps, are
# small, and padding them would cost more than their few compiles.
_EXACT_ROWS = 16


def row_bucket(rows: int) -> int:
    """The row count a projection of `rows` rows runs at: itself up to 16, then the next
    multiple of 1/8 of its power of two (18, 20, ..., 32, 36, ..., 64, 72, ...), so at most
    12.5% of the rows are padding and there are 8 shapes per doubling."""
    if rows <= _EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ W^T + bias with W packed by `pack_weight`, run at `row_bucket` rows (the
    padding rows are zeros and their outputs are dropped; rows do not mix in a product)."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    pad = row_bucket(rows) - rows
    if pad:
        flat = nn.functional.pad(flat, (0, 0, 0, pad))
    out = _onednn_linear(flat, packed, bias)
    if pad:
        out = out[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


class PackedLinearMixin:
    """For nn.Linear subclasses: `pack()` swaps the dense weight for a packed one, and
    `linear(x, bias)` is x @ W^T (+ bias) with whichever the layer holds: a weight kept in
    GGUF blocks (`quant`, engine.models.quant_linear), the packed one, or the dense one."""

    packed_weight: torch.Tensor | None = None
    quant = None  # QuantWeight, Int8Weight or HalfWeight: set by the loader in place of `weight`

    def pack(self) -> bool:
        if self.quant is not None:
            return False
        packed = pack_weight(self.weight)
        if packed is None:
            return False
        self.packed_weight = packed
        self.weight = None
        return True

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.quant is not None:
            y = self.quant.matmul(x)
            return y if bias is None else y + bias
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, bias)
        return nn.functional.linear(x, self.weight, bias)


def pack_model_linears(model: nn.Module) -> int:
    """Pack every projection of `model` that supports it; returns how many were packed."""
    n = sum(1 for m in model.modules() if isinstance(m, PackedLinearMixin) and m.pack())
    if n:
        logger.debug("packed %d linear weights for oneDNN", n)
    return n
