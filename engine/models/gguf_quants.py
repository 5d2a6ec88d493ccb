"""GGUF tensor data -> dense float tensors, in torch, all blocks at once.

We keep no quantized weights at run time: each tensor is expanded once at load and then
lives in the compute dtype like a safetensors weight. The block layouts are ggml's:
a quantized row is a run of 32-element blocks, each a little-endian fp16 scale (`d`),
for Q4_1 an fp16 offset (`m`), then the packed integers. In a Q4 block the low nibbles
of its 16 bytes are elements 0..15 and the high nibbles elements 16..31.
"""

from __future__ import annotations

import torch

QK = 32  # elements per block of every quantized type we read
# type name -> bytes per block (per element for the float types)
SUPPORTED_TYPES = {"F32": 4, "F16": 2, "BF16": 2, "Q8_0": 2 + QK, "Q4_0": 2 + QK // 2, "Q4_1": 4 + QK // 2}


def check_type(type_name: str, tensor_name: str) -> None:
    if type_name not in SUPPORTED_TYPES:
        raise ValueError(f"GGUF tensor {tensor_name!r} has quantization type {type_name}; "
                         f"supported: {sorted(SUPPORTED_TYPES)}")


def dequantize(raw: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """raw: uint8 [nbytes], the tensor's bytes as stored; shape: row-major (PyTorch order,
    i.e. GGUF's dimensions reversed). Returns fp32 (or the stored float type) of `shape`."""
    numel = 1
    for n in shape:
        numel *= n
    quantized = type_name in _DEQUANT
    if quantized and numel % QK:
        raise ValueError(f"a {type_name} tensor of shape {shape} is not made of {QK}-element blocks")
    nbytes = numel // QK * SUPPORTED_TYPES[type_name] if quantized else numel * SUPPORTED_TYPES[type_name]
    if raw.numel() != nbytes:
        raise ValueError(f"GGUF data of a {type_name} tensor of shape {shape} is {raw.numel()} bytes, "
                         f"expected {nbytes}")
    if type_name == "F32":
        out = raw.view(torch.float32)
    elif type_name == "F16":
        out = raw.view(torch.float16)
    elif type_name == "BF16":
        out = raw.view(torch.bfloat16)
    else:
        out = _DEQUANT[type_name](raw.view(numel // QK, SUPPORTED_TYPES[type_name]))  # [nblocks, QK]
    return out.reshape(shape)


def _fp16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of every block, as fp32 [nblocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[nblocks, QK/2] bytes -> [nblocks, QK] values 0..15 (low nibbles first)."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    q = blocks[:, 2:].contiguous().view(torch.int8)
    return _fp16(blocks, 0) * q.float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # Symmetric: the nibble stores q + 8.
    return _fp16(blocks, 0) * (_nibbles(blocks[:, 2:]).float() - 8.0)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # Affine: d * q + m, with m the block minimum.
    return _fp16(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _fp16(blocks, 2)


_DEQUANT = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1}
