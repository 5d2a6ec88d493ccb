"""Native CPU kernels (C, built on first use by kernels.cpu.build) behind the contract of
kernels.reference: same signatures, same results up to float rounding.

`paged_attention` runs rows with at most `NATIVE_MAX_QUERY_LEN` query tokens (decode, short
chunks) in C straight off the paged cache (a sliding window's rows from its first visible key
on), longer ones through SDPA: up to `BLOCKED_MAX_CONTEXT` keys in blocks of queries
(`prefill_attention`), past it (or windowed, soft-capped) through the reference's prefill
path. The per-token ops (rms_norm, silu_and_mul, gelu_tanh_and_mul, neox rotary,
reshape_and_cache) are one fused pass each.
Whatever the C code does not cover (not fp32, odd sizes or strides, no compiler,
PDSERVE_CPU_KERNELS=0) runs the reference unchanged.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

import kernels.reference as reference
from kernels.cpu.build import library

# Longer runs of query tokens are prefills: SDPA's GEMMs beat per-query dot products there.
NATIVE_MAX_QUERY_LEN = 16
_MAX_HEADS_X_DIM = 16384  # MAX_HD in paged_attention.c
# torch's CPU flash attention spends as much on a causal prompt of a few hundred tokens as on
# a full one (measured, 8 heads of 64: 512 tokens 6.9 ms either way), where longer ones do
# skip the masked half. Blocks of QUERY_BLOCK queries, each over the keys up to its last, skip
# most of it: 24% less attention time over prompts of 1-512 tokens (2-core AVX-512 EPYC).
QUERY_BLOCK = 64
BLOCKED_MAX_CONTEXT = 1024
F32 = torch.float32


def _rows(x: torch.Tensor) -> bool:
    """x is fp32 rows of a multiple of 8 floats, each row contiguous, rows evenly strided."""
    return (x.dtype == F32 and x.device.type == "cpu" and x.shape[-1] % 8 == 0 and x.stride(-1) == 1
            and (x.dim() == 2 or x.is_contiguous()))


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [R, max_blocks] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D]
    *,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """kernels.reference.paged_attention, short query runs in C (module docstring)."""
    if out is None:
        out = torch.empty_like(q)
    lib = library()
    D = q.shape[-1]
    native = (
        lib is not None and q.device.type == "cpu"
        and q.dtype == key_cache.dtype == value_cache.dtype == out.dtype == F32
        and D % 8 == 0 and q.shape[1] * D <= _MAX_HEADS_X_DIM and q.stride(-1) == 1 and out.stride(-1) == 1
        and key_cache.is_contiguous() and value_cache.is_contiguous()
        and block_table.dtype == query_start_loc.dtype == seq_lens.dtype == torch.int32
        and block_table.stride(-1) == 1 and query_start_loc.is_contiguous() and seq_lens.is_contiguous()
    )
    if not native:
        return reference.paged_attention(q, key_cache, value_cache, block_table, query_start_loc,
                                         seq_lens, scale, out, sliding_window=sliding_window,
                                         softcap=softcap)
    _, block_size, Hkv, _ = key_cache.shape
    lib.paged_attention_rows_f32(
        q.data_ptr(), q.stride(0), q.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
        block_table.data_ptr(), block_table.stride(0), query_start_loc.data_ptr(), seq_lens.data_ptr(),
        seq_lens.shape[0], NATIVE_MAX_QUERY_LEN, q.shape[1], Hkv, D, block_size, scale,
        max(sliding_window, 0), max(softcap, 0.0), out.data_ptr(), out.stride(0), out.stride(1),
        torch.get_num_threads(),
    )
    starts = query_start_loc.numpy()
    long = np.flatnonzero(np.diff(starts) > NATIVE_MAX_QUERY_LEN)
    if len(long):
        starts, ctx = starts.tolist(), seq_lens.tolist()
        rows = long.tolist()
        if not sliding_window and not softcap:
            blocked = [r for r in rows if ctx[r] <= BLOCKED_MAX_CONTEXT]
            prefill_attention(q, key_cache, value_cache, block_table, starts, ctx, blocked, scale,
                              out)
            rows = [r for r in rows if ctx[r] > BLOCKED_MAX_CONTEXT]
        reference.prefill_attention(q, key_cache, value_cache, block_table, starts, ctx, rows,
                                    scale, out, sliding_window, softcap)
    return out


def prefill_attention(q, key_cache, value_cache, block_table, starts: list[int], ctx: list[int],
                      rows: list[int], scale: float, out: torch.Tensor) -> None:
    """reference.prefill_attention without a window or softcap, each row's queries in blocks
    of QUERY_BLOCK: a block's SDPA reads only the keys up to its last query."""
    for r in rows:
        q_len, L = starts[r + 1] - starts[r], ctx[r]
        # k, v: [1, Hkv, L, D]
        k, v = reference.gather_context(key_cache, value_cache, block_table[r:r + 1], L)
        qr = q[starts[r]:starts[r + 1]].transpose(0, 1).unsqueeze(0).float()  # [1, H, q_len, D]
        # Query i sits at position L - q_len + i and sees keys [0, L - q_len + i].
        mask = torch.ones(q_len, L, dtype=torch.bool).tril(L - q_len)
        gqa = k.shape[1] != q.shape[1]
        for i0 in range(0, q_len, QUERY_BLOCK):
            i1 = min(i0 + QUERY_BLOCK, q_len)
            n_keys = L - q_len + i1
            o = F.scaled_dot_product_attention(qr[:, :, i0:i1], k[:, :, :n_keys], v[:, :, :n_keys],
                                               attn_mask=mask[i0:i1, :n_keys], scale=scale,
                                               enable_gqa=gqa)
            out[starts[r] + i0:starts[r] + i1] = o[0].transpose(0, 1).to(out.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """kernels.reference.rms_norm in one pass per row."""
    lib = library()
    if (lib is None or not _rows(x) or weight.dtype != F32 or not weight.is_contiguous()
            or (residual is not None and (not _rows(residual) or residual.shape != x.shape))):
        return reference.rms_norm(x, weight, eps, residual)
    d = x.shape[-1]
    T = x.numel() // d
    out = torch.empty(x.shape, dtype=F32)
    summed = None if residual is None else torch.empty(x.shape, dtype=F32)
    lib.rms_norm_f32(
        x.data_ptr(), x.stride(-2) if x.dim() > 1 else d,
        None if residual is None else residual.data_ptr(),
        0 if residual is None else (residual.stride(-2) if residual.dim() > 1 else d),
        weight.data_ptr(), eps, out.data_ptr(), None if summed is None else summed.data_ptr(), T, d,
        torch.get_num_threads(),
    )
    return out if residual is None else (out, summed)


def _act_and_mul(x: torch.Tensor, c_name: str, fallback) -> torch.Tensor:
    """x [..., 2d] -> act(x[..., :d]) * x[..., d:] in one C pass (`c_name`), else `fallback`."""
    lib = library()
    d = x.shape[-1] // 2
    if lib is None or not _rows(x) or d % 8:
        return fallback(x)
    T = x.numel() // x.shape[-1]
    out = torch.empty((*x.shape[:-1], d), dtype=F32)
    getattr(lib, c_name)(x.data_ptr(), x.stride(-2) if x.dim() > 1 else 2 * d, out.data_ptr(), T, d,
                         torch.get_num_threads())
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """kernels.reference.silu_and_mul in one pass."""
    return _act_and_mul(x, "silu_and_mul_f32", reference.silu_and_mul)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """kernels.reference.gelu_tanh_and_mul in one pass."""
    return _act_and_mul(x, "gelu_tanh_and_mul_f32", reference.gelu_tanh_and_mul)


def rotary_embedding(positions, q, k, cos_sin_cache, is_neox: bool = True):
    """kernels.reference.rotary_embedding; the neox layout in one pass over q and k."""
    lib = library()
    rot = cos_sin_cache.shape[-1]
    if (lib is None or not is_neox or (rot // 2) % 8 or q.dim() != 3 or k.dim() != 3
            or q.dtype != F32 or k.dtype != F32 or cos_sin_cache.dtype != F32
            or q.stride(-1) != 1 or k.stride(-1) != 1 or not cos_sin_cache.is_contiguous()
            or positions.dtype != torch.int64 or not positions.is_contiguous()):
        return reference.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
    T, H, D = q.shape
    Hkv = k.shape[1]
    q_out = torch.empty((T, H, D), dtype=F32)
    k_out = torch.empty((T, Hkv, D), dtype=F32)
    lib.rotary_neox_f32(positions.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(),
                        k.stride(0), k.stride(1), cos_sin_cache.data_ptr(), rot, q_out.data_ptr(),
                        k_out.data_ptr(), T, H, Hkv, D, torch.get_num_threads())
    return q_out, k_out


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """kernels.reference.reshape_and_cache as a copy per token and head."""
    lib = library()
    if (lib is None or key.dim() != 3 or value.dim() != 3
            or not key.dtype == value.dtype == key_cache.dtype == value_cache.dtype == F32
            or key.stride(-1) != 1 or value.stride(-1) != 1
            or not key_cache.is_contiguous() or not value_cache.is_contiguous()
            or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()):
        reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    T, Hkv, D = key.shape
    lib.reshape_and_cache_f32(key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(),
                              value.stride(0), value.stride(1), key_cache.data_ptr(),
                              value_cache.data_ptr(), slot_mapping.data_ptr(), T, Hkv, D)
