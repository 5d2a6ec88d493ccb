"""Torch references for every kernel in the contract (ARCHITECTURE.md §3).

They are the specification the Triton kernels are tested against, and the implementation the
engine runs on CPU. Each is written for clarity first, vectorised where the CPU path needs it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = padding (skip)
) -> None:
    """Write each token's K/V into its paged slot (slot = block * block_size + offset)."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    num_blocks, block_size = key_cache.shape[:2]
    key_cache.view(num_blocks * block_size, *key_cache.shape[2:])[slot_mapping] = key.to(key_cache.dtype)
    value_cache.view(num_blocks * block_size, *value_cache.shape[2:])[slot_mapping] = value.to(
        value_cache.dtype
    )


def paged_attention(
    q: torch.Tensor,  # [T, H, D] flattened super-sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [R, max_blocks] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32, context length including this step's tokens
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D]
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged context.

    Query i of a request with q_len new tokens sees keys [0, seq_len - q_len + i]. KV heads
    are shared by groups of H // Hkv query heads (GQA/MQA).
    """
    T, H, D = q.shape
    block_size = key_cache.shape[1]
    R = seq_lens.shape[0]
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()  # [R]
    ctx = seq_lens.long()  # [R]
    max_q = int(q_lens.max())
    max_k = int(ctx.max())
    nb = -(-max_k // block_size)

    # Gather each request's context into a padded dense tensor: [R, Hkv, max_k, D].
    # (index_select over flat block ids is much faster on CPU than advanced indexing)
    blocks = block_table[:, :nb].reshape(-1).long()
    Hkv = key_cache.shape[2]
    k = key_cache.index_select(0, blocks).view(R, nb * block_size, Hkv, D)[:, :max_k].transpose(1, 2)
    v = value_cache.index_select(0, blocks).view(R, nb * block_size, Hkv, D)[:, :max_k].transpose(1, 2)

    # Scatter the flat queries into [R, H, max_q, D] (decode-only batches need no padding).
    if max_q == 1 and T == R:
        qp = q.view(R, 1, H, D).transpose(1, 2)
        row = torch.zeros(R, 1, dtype=torch.long)
    else:
        qp = q.new_zeros(R, max_q, H, D)
        req_idx = torch.repeat_interleave(torch.arange(R), q_lens)
        row = torch.arange(T) - query_start_loc[:-1].long()[req_idx]
        qp[req_idx, row] = q
        qp = qp.transpose(1, 2)
        row = torch.arange(max_q).unsqueeze(0).expand(R, max_q)

    # Visible key span per query row; padded rows see key 0 only, so no row is all -inf.
    last_visible = ctx.unsqueeze(1) - q_lens.unsqueeze(1) + row  # [R, max_q]
    last_visible = torch.where(row < q_lens.unsqueeze(1), last_visible, torch.zeros_like(last_visible))
    mask = torch.arange(max_k).view(1, 1, max_k) <= last_visible.unsqueeze(-1)  # [R, max_q, max_k]
    o = F.scaled_dot_product_attention(
        qp.float(), k.float(), v.float(), attn_mask=mask.unsqueeze(1), scale=scale,
        enable_gqa=k.shape[1] != H,
    )  # [R, H, max_q, D]
    o = o.transpose(1, 2)  # [R, max_q, H, D]
    if max_q == 1 and T == R:
        flat = o.reshape(T, H, D)
    else:
        flat = o[req_idx, torch.arange(T) - query_start_loc[:-1].long()[req_idx]]
    if out is None:
        return flat.to(q.dtype)
    out.copy_(flat)
    return out


def rms_norm(
    x: torch.Tensor,  # [T, d]
    weight: torch.Tensor,  # [d]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, d]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in fp32; with `residual`, normalises x + residual and returns (out, x + residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return out if residual is None else (out, residual)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim] = cat(cos, sin) over rot_dim // 2
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first rot_dim dims of each head. neox rotates (first half, second half)
    pairs; GPT-J rotates interleaved (even, odd) pairs."""
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # [T, rot_dim // 2]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xr, xp = x[..., :rot_dim].float(), x[..., rot_dim:]
        if is_neox:
            x1, x2 = xr.chunk(2, dim=-1)
            r = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            r = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat((r.to(x.dtype), xp), dim=-1)

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] -> silu(x[..., :d]) * x[..., d:]"""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
