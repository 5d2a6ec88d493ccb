"""GGUF tensor data -> dense float tensors, in torch, all blocks at once.

We keep no quantized weights at run time: each tensor is expanded once at load and then
lives in the compute dtype like a safetensors weight. The block layouts are ggml's: a
quantized row is a run of blocks of 32 values (Q4_0 ... IQ4_NL) or 256 values (the K-quants
and IQ4_XS), each a few little-endian fp16 scales and packed integers. Every decoder takes a
uint8 [nblocks, block bytes] view and returns fp32 [nblocks, block values], computing in the
order `gguf.quants.dequantize` does, so the results are equal bit for bit.

Bit fields are packed in planes: a run of bytes holds its values' low bits, then the same
bytes' next bits hold the next values (a Q4_0 block's 16 bytes hold values 0..15 in their
low nibbles and 16..31 in their high nibbles); `_planes` unpacks that pattern.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from engine.errors import ParameterError

QK, QK_K = 32, 256  # values per block of the plain and of the K-quant (and IQ4_XS) types
_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# The non-linear 4-bit levels of IQ4_NL and IQ4_XS (ggml's kvalues_iq4nl).
_IQ4_LEVELS = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                           dtype=torch.float32)


class BlockType(NamedTuple):
    values: int  # per block
    nbytes: int  # per block
    decode: Callable[[torch.Tensor], torch.Tensor]  # uint8 [nblocks, nbytes] -> fp32 [nblocks, values]


def check_type(type_name: str, tensor_name: str) -> None:
    if type_name not in SUPPORTED_TYPES:
        raise ParameterError("model", f"GGUF tensor {tensor_name!r} has quantization type {type_name}; "
                             f"supported: {list(SUPPORTED_TYPES)}")


def dequantize(raw: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """raw: uint8 [nbytes], the tensor's bytes as stored; shape: row-major (PyTorch order,
    i.e. GGUF's dimensions reversed). Returns fp32 (or the stored float type) of `shape`."""
    numel = 1
    for n in shape:
        numel *= n
    if type_name in _FLOATS:
        dtype = _FLOATS[type_name]
        _check_size(raw, type_name, shape, numel * dtype.itemsize)
        return raw.view(dtype).reshape(shape)
    block = _BLOCKS[type_name]
    # Blocks never span rows: llama.cpp quantizes a tensor only if its rows are whole blocks.
    if not shape or shape[-1] % block.values:
        raise ValueError(f"a {type_name} tensor of shape {shape} does not have rows of whole "
                         f"{block.values}-value blocks")
    nblocks = numel // block.values
    _check_size(raw, type_name, shape, nblocks * block.nbytes)
    return block.decode(raw.view(nblocks, block.nbytes)).reshape(shape)


def _check_size(raw: torch.Tensor, type_name: str, shape: tuple[int, ...], nbytes: int) -> None:
    if raw.numel() != nbytes:
        raise ValueError(f"GGUF data of a {type_name} tensor of shape {shape} is {raw.numel()} bytes, "
                         f"expected {nbytes}")


def _fp16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of every block, as fp32 [nblocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _planes(packed: torch.Tensor, run: int, bits: int) -> torch.Tensor:
    """uint8 [nblocks, B] -> uint8 [nblocks, B/run, 8/bits, run]: each run of `run` bytes split
    into its `bits`-wide fields, lowest bits first. Flattened, that is ggml's value order."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    fields = packed.reshape(packed.shape[0], -1, 1, run) >> shifts.reshape(1, 1, -1, 1)
    return fields & ((1 << bits) - 1)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[nblocks, QK/2] bytes -> [nblocks, QK] values 0..15 (low nibbles first)."""
    return _planes(packed, QK // 2, 4).reshape(-1, QK)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """[nblocks, B] bytes (a little-endian bit mask) -> [nblocks, 8*B] values 0..1, bit i the
    i-th value."""
    return _planes(packed, 1, 1).reshape(packed.shape[0], -1)


def _iq4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes -> IQ4's levels, fp32 of the same shape."""
    return _IQ4_LEVELS.to(codes.device)[codes.long()]


# Q8_0: d | int8 q[32]; d * q.
def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    q = blocks[:, 2:].contiguous().view(torch.int8)
    return _fp16(blocks, 0) * q.float()


# Q4_0: d | q[32] in nibbles; symmetric, the nibble stores q + 8.
def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _fp16(blocks, 0) * (_nibbles(blocks[:, 2:]).float() - 8.0)


# Q4_1: d | m | q[32] in nibbles; affine, d * q + m with m the block minimum.
def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _fp16(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _fp16(blocks, 2)


def _five_bit(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Q5's values 0..31: a 32-bit mask of fifth bits and Q4's nibbles."""
    return _nibbles(low) | (_bits(high) << 4)


# Q5_0: d | fifth bits (u32) | nibbles; the 5-bit value stores q + 16.
def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    return _fp16(blocks, 0) * (_five_bit(blocks[:, 2:6], blocks[:, 6:]).float() - 16.0)


# Q5_1: d | m | fifth bits (u32) | nibbles; d * q + m.
def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    return _fp16(blocks, 0) * _five_bit(blocks[:, 4:8], blocks[:, 8:]).float() + _fp16(blocks, 2)


# IQ4_NL: d | codes[32] in nibbles; d * level[code].
def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    return _fp16(blocks, 0) * _iq4(_nibbles(blocks[:, 2:]))


# Q2_K: scales[16] (low nibble: the scale, high nibble: the min, of 16 values each) |
# q[256] in 2-bit planes | d | dmin; (d * scale) * q - dmin * min.
def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, :16]
    dl = (_fp16(blocks, 80) * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (_fp16(blocks, 82) * (scales >> 4).float()).reshape(n, 16, 1)
    q = _planes(blocks[:, 16:80], 32, 2).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


# Q3_K: hmask[32] (a value's third bit, in 1-bit planes) | low 2 bits in 2-bit planes |
# 16 6-bit scales in 12 bytes | d; (d * (scale - 32)) * q with q = low - 4 where the hmask
# bit is clear (ggml stores the offset inverted).
def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    packed = blocks[:, 96:108]
    # Bytes 0..7 hold the scales' low nibbles (0..7 low, 8..15 high); bytes 8..11 their high
    # 2 bits, scale 4*j+k at bits 2j of byte 8+k.
    scales = _planes(packed[:, :8], 8, 4).reshape(n, 16) | (_planes(packed[:, 8:], 4, 2).reshape(n, 16) << 4)
    dl = (_fp16(blocks, 108) * (scales.float() - 32.0)).reshape(n, 16, 1)
    low = _planes(blocks[:, 32:96], 32, 2).reshape(n, 16, 16)
    offset = (_planes(blocks[:, :32], 32, 1).reshape(n, 16, 16) ^ 1) << 2
    return (dl * (low.float() - offset.float())).reshape(n, QK_K)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> (scales, mins), each 8 6-bit values as fp32 [nblocks, 8, 1].
    Bytes 0..3 and 4..7 hold scales and mins 0..3 in their low 6 bits and the top 2 bits of
    4..7 in their high 2; bytes 8..11 hold the low 4 bits of 4..7 (scales low, mins high)."""
    sc, mn, low = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((sc & 0x3F, (low & 0x0F) | ((sc >> 2) & 0x30)), dim=1)
    mins = torch.cat((mn & 0x3F, (low >> 4) | ((mn >> 2) & 0x30)), dim=1)
    return scales.float().unsqueeze(2), mins.float().unsqueeze(2)


# Q4_K: d | dmin | scales (12 bytes) | q[256] in nibbles, 32-byte runs; per 32 values
# (d * scale) * q - dmin * min.
def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales, mins = _k_scales(blocks[:, 4:16])
    q = _planes(blocks[:, 16:], 32, 4).reshape(n, 8, 32).float()
    return (_fp16(blocks, 0).unsqueeze(2) * scales * q - _fp16(blocks, 2).unsqueeze(2) * mins).reshape(n, QK_K)


# Q5_K: Q4_K's fields with a fifth bit per value, in 1-bit planes of 32 bytes, before the nibbles.
def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales, mins = _k_scales(blocks[:, 4:16])
    high = _planes(blocks[:, 16:48], 32, 1).reshape(n, 8, 32)
    q = (_planes(blocks[:, 48:], 32, 4).reshape(n, 8, 32) | (high << 4)).float()
    return (_fp16(blocks, 0).unsqueeze(2) * scales * q - _fp16(blocks, 2).unsqueeze(2) * mins).reshape(n, QK_K)


# Q6_K: low nibbles (64-byte runs) | high 2 bits (2-bit planes, 32-byte runs) | int8 scales[16]
# | d; (d * scale) * (q - 32) per 16 values.
def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    dl = (_fp16(blocks, 208) * scales).reshape(n, 16, 1)
    low = _planes(blocks[:, :128], 64, 4).reshape(n, 16, 16)
    high = _planes(blocks[:, 128:192], 32, 2).reshape(n, 16, 16)
    return (dl * ((low | (high << 4)).float() - 32.0)).reshape(n, QK_K)


# IQ4_XS: d | scales' high 2 bits (u16) | their low nibbles[4] | codes[256] in nibbles, 16-byte
# runs; per 32 values (d * (scale - 32)) * level[code].
def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = _planes(blocks[:, 4:8], 1, 4).reshape(n, 8) | (_planes(blocks[:, 2:4], 1, 2).reshape(n, 8) << 4)
    dl = (_fp16(blocks, 0) * (scales.float() - 32.0)).reshape(n, 8, 1)
    return (dl * _iq4(_planes(blocks[:, 8:], 16, 4).reshape(n, 8, 32))).reshape(n, QK_K)


_BLOCKS = {
    "Q8_0": BlockType(QK, 2 + QK, _q8_0),
    "Q4_0": BlockType(QK, 2 + QK // 2, _q4_0),
    "Q4_1": BlockType(QK, 4 + QK // 2, _q4_1),
    "Q5_0": BlockType(QK, 6 + QK // 2, _q5_0),
    "Q5_1": BlockType(QK, 8 + QK // 2, _q5_1),
    "IQ4_NL": BlockType(QK, 2 + QK // 2, _iq4_nl),
    "Q2_K": BlockType(QK_K, QK_K // 16 + QK_K // 4 + 4, _q2_k),
    "Q3_K": BlockType(QK_K, QK_K // 8 + QK_K // 4 + 12 + 2, _q3_k),
    "Q4_K": BlockType(QK_K, 4 + 12 + QK_K // 2, _q4_k),
    "Q5_K": BlockType(QK_K, 4 + 12 + QK_K // 8 + QK_K // 2, _q5_k),
    "Q6_K": BlockType(QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2, _q6_k),
    "IQ4_XS": BlockType(QK_K, 4 + QK_K // 64 + QK_K // 2, _iq4_xs),
}
SUPPORTED_TYPES = tuple(sorted((*_FLOATS, *_BLOCKS)))


def is_float_type(type_name: str) -> bool:
    return type_name in _FLOATS


def block_shape(type_name: str) -> tuple[int, int]:
    """(values, bytes) per block of a quantized type."""
    block = _BLOCKS[type_name]
    return block.values, block.nbytes
