"""Unpack a quantized Hugging Face projection (GPTQ, AWQ, compressed-tensors) into one form,
and repack it into GGUF blocks the CPU kernels (kernels.cpu.quant) multiply.

Every method stores w[n, k] = scale[n, g] * (q[n, k] - zero[n, g]), g the group of input column
k, q and zero small unsigned integers. `GroupQuant` holds exactly that, whatever the packing.

Repacking is exact, not a re-quantization: a 32-column block whose columns share one group has
one scale, and q - zero fits the integer range of a GGUF type whose value is d * integer:
Q4_0 for [-8, 7] (symmetric 4-bit), Q5_0 for [-16, 15] (4-bit with zero points, GPTQ v1's +1
included), Q8_0 for [-128, 127] (symmetric 8-bit). d is fp16 in a GGUF block, so the scales
must be fp16 values (GPTQ and AWQ store fp16; bf16 scales near 1e-3 are fp16 values too).
Then d * integer in fp32 is the checkpoint's own dequantization, bit for bit. GPTQ's act-order
(`desc_act`, `g_idx`) scatters a group's columns: the columns are sorted by group once at load
(`perm`) and each product gathers the activations in that order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# GPTQ packs 32 // bits values per int32 along the input dim, value i in bits [bits*i, bits*(i+1)).
# AWQ's GEMM layout packs 8 output columns per int32 in this order of nibbles.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
BLOCK = 32  # values per GGUF block of the types below
# type -> (least, greatest) q - zero it holds exactly, and the bias its stored value adds.
_RANGES = {"Q4_0": (-8, 7, 8), "Q5_0": (-16, 15, 16), "Q8_0": (-128, 127, 0)}


@dataclass
class GroupQuant:
    """w = scales[:, g_idx] * (q - zeros[:, g_idx]) for one [N, K] projection."""

    q: torch.Tensor  # int16 [N, K]
    zeros: torch.Tensor  # int16 [N, G]
    scales: torch.Tensor  # float [N, G], the checkpoint's dtype
    g_idx: torch.Tensor  # int64 [K], each input column's group

    def dequantize(self) -> torch.Tensor:
        """The dense fp32 weight [N, K]."""
        return self.scales.float()[:, self.g_idx] * (self.q - self.zeros[:, self.g_idx]).float()


def unpack_bits(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> int16 values, 32 // bits per word along `dim` (value i in bits i*bits...)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    p = packed.to(torch.int32)
    if dim == 0:
        vals = (p[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)  # [R, per, C]
        return vals.reshape(p.shape[0] * per, p.shape[1]).to(torch.int16)
    vals = (p[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)  # [R, C, per]
    return vals.reshape(p.shape[0], p.shape[1] * per).to(torch.int16)


def _groups(g_idx: torch.Tensor | None, k: int, num_groups: int) -> torch.Tensor:
    if g_idx is not None:
        return g_idx.to(torch.int64)
    if k % num_groups:
        raise ValueError(f"{k} input columns do not split into {num_groups} equal groups")
    return torch.arange(k) // (k // num_groups)


def from_gptq(t: dict[str, torch.Tensor], bits: int, zero_offset: int) -> GroupQuant:
    """GPTQ: qweight int32 [K*bits/32, N] (packed along K), qzeros int32 [G, N*bits/32]
    (along N), scales [G, N], optional g_idx [K]."""
    q = unpack_bits(t["qweight"], bits, 0).T  # [N, K]
    zeros = (unpack_bits(t["qzeros"], bits, 1) + zero_offset).T  # [N, G]
    scales = t["scales"].T
    return GroupQuant(q.contiguous(), zeros.contiguous(), scales.contiguous(),
                      _groups(t.get("g_idx"), q.shape[1], scales.shape[1]))


def from_awq(t: dict[str, torch.Tensor]) -> GroupQuant:
    """AWQ GEMM: qweight int32 [K, N/8] and qzeros int32 [G, N/8] (packed along N, nibbles in
    AWQ_ORDER), scales [G, N]."""
    inverse = torch.tensor([AWQ_ORDER.index(i) for i in range(8)])

    def natural(packed: torch.Tensor) -> torch.Tensor:
        vals = unpack_bits(packed, 4, 1)  # word j's nibbles in stored order
        return vals.view(vals.shape[0], -1, 8)[:, :, inverse].reshape(vals.shape)

    q, zeros, scales = natural(t["qweight"]).T, natural(t["qzeros"]).T, t["scales"].T
    return GroupQuant(q.contiguous(), zeros.contiguous(), scales.contiguous(),
                      _groups(None, q.shape[1], scales.shape[1]))


def from_compressed_tensors(t: dict[str, torch.Tensor], bits: int) -> GroupQuant:
    """compressed-tensors: pack-quantized weight_packed int32 [N, K/8] (along K, each nibble
    the signed value + 8), or int8 `weight` [N, K]; weight_scale [N, G]; asymmetric
    weight_zero_point packed along N likewise; optional weight_g_idx [K]."""
    bias = 1 << (bits - 1)
    if bits == 4:
        n, k = (int(v) for v in t["weight_shape"])
        q = unpack_bits(t["weight_packed"], 4, 1)[:, :k]
    else:
        q = t["weight"].to(torch.int16) + bias
        n, k = q.shape
    scales = t["weight_scale"].reshape(n, -1)
    if "weight_zero_point" in t:
        zp = t["weight_zero_point"]
        zeros = unpack_bits(zp, bits, 0)[:n] if zp.dtype == torch.int32 and bits == 4 else zp.to(torch.int16) + bias
        zeros = zeros.reshape(n, -1)
    else:
        zeros = torch.full_like(scales, bias, dtype=torch.int16)
    return GroupQuant(q.contiguous(), zeros.contiguous(), scales.contiguous(),
                      _groups(t.get("weight_g_idx"), k, scales.shape[1]))


def block_order(g_idx: torch.Tensor) -> torch.Tensor | None:
    """The column order that makes each group's columns contiguous (None: already so)."""
    if bool((g_idx[1:] >= g_idx[:-1]).all()):
        return None
    return torch.argsort(g_idx, stable=True)


def to_blocks(w: GroupQuant) -> tuple[str, torch.Tensor, torch.Tensor | None] | None:
    """(GGUF type, uint8 [N, row bytes], column order or None) holding w exactly; None when no
    block type does (a group not a whole number of blocks, non-fp16 scales, a wide range)."""
    n, k = w.q.shape
    if k % BLOCK:
        return None
    perm = block_order(w.g_idx)
    g = w.g_idx if perm is None else w.g_idx[perm]
    blocks_g = g.view(-1, BLOCK)
    if not bool((blocks_g == blocks_g[:, :1]).all()):
        return None  # a block would straddle two groups
    d = w.scales.to(torch.float16)
    if not bool(torch.isfinite(d).all()) or not torch.equal(d.to(w.scales.dtype), w.scales):
        return None
    q = w.q if perm is None else w.q[:, perm]
    gb = blocks_g[:, 0]  # group of each block
    v = (q.view(n, -1, BLOCK) - w.zeros[:, gb][:, :, None]).to(torch.int32)  # [N, nb, 32]
    lo, hi = int(v.min()), int(v.max())
    qtype = next((t for t, (a, b, _) in _RANGES.items() if a <= lo and hi <= b), None)
    if qtype is None:
        return None
    v = v + _RANGES[qtype][2]
    head = d[:, gb].contiguous().view(torch.uint8).view(n, -1, 2)  # fp16 d of each block
    if qtype == "Q8_0":
        body = v.to(torch.int8).view(torch.uint8)
    else:
        low = v & 0xF
        body = (low[:, :, :16] | (low[:, :, 16:] << 4)).to(torch.uint8)
        if qtype == "Q5_0":
            fifth = ((v >> 4) & 1).to(torch.int64) << torch.arange(32, dtype=torch.int64)
            qh = fifth.sum(dim=2, dtype=torch.int64)  # bit j: value j's fifth bit
            body = torch.cat([qh[:, :, None].view(torch.uint8)[:, :, :4], body], dim=2)  # u32, little-endian
    return qtype, torch.cat([head, body], dim=2).reshape(n, -1).contiguous(), perm
