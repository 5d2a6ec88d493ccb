"""Gated activations, x [..., 2d] -> act(x[..., :d]) * x[..., d:]: silu_and_mul (SwiGLU) and
gelu_tanh_and_mul (GeGLU, Gemma's MLP)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    # Rounded like the unfused reference: silu(gate) in the activation dtype, then the product.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_tanh_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    # 0.5 g (1 + tanh(y)) = g * sigmoid(2y) (tl has no tanh), from e = e^(-2|y|) in (0, 1] so
    # that nothing overflows, and without the cancellation of 1 + tanh(y) for negative g.
    y = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    e = tl.exp(-2.0 * tl.abs(y))
    act = (gate * tl.where(y >= 0, 1.0, e) / (1.0 + e)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _gated(kernel, x):
    shape = x.shape
    d = shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    assert x2.stride(-1) == 1
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    if x2.shape[0]:
        kernel[(x2.shape[0], triton.cdiv(d, block))](x2, out, x2.stride(0), out.stride(0), d, BLOCK=block)
    return out.view(*shape[:-1], d)


def silu_and_mul(x):
    return _gated(_silu_and_mul_kernel, x)


def gelu_tanh_and_mul(x):
    return _gated(_gelu_tanh_and_mul_kernel, x)
