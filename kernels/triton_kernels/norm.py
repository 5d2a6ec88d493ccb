"""RMSNorm with optional fused residual add."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    x_stride, res_stride, out_stride, res_out_stride, dim, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype, as the unfused `x + residual` would be.
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * res_out_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / dim + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x, weight, eps, residual=None):
    """x [..., d] -> out, or (out, x + residual) with a residual (same as the reference)."""
    shape = x.shape
    d = shape[-1]
    x2 = x.reshape(-1, d)
    assert x2.stride(-1) == 1, "last dim must be contiguous"
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = None
    res2 = x2
    if residual is not None:
        res2 = residual.reshape(-1, d)
        res_out = torch.empty_like(out)
    rows = x2.shape[0]
    if rows:
        _rms_norm_kernel[(rows,)](
            x2, res2, weight, out, res_out if res_out is not None else out,
            x2.stride(0), res2.stride(0), out.stride(0),
            (res_out if res_out is not None else out).stride(0), d, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(d),
        )
    out = out.view(shape)
    return out if residual is None else (out, res_out.view(shape))
