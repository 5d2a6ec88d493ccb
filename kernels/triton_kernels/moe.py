"""fused_moe: each token's top-k experts' SwiGLU MLPs, weighted and summed (contract and
spec in kernels.reference.fused_moe).

The (token, slot) pairs are sorted by expert and each expert's run is padded to a multiple of
BLOCK_M, so every M-tile of the sorted list belongs to one expert: the two kernels are grouped
GEMMs whose tiles read that expert's weights. The first computes silu(gate) * up into an
[T*k, inter] intermediate; the second multiplies by the expert's down projection and scales each
row by its routing weight. The k rows of a token are then summed in fp32.

Under expert parallelism (`expert_start`) the weights hold one rank's experts; pairs routed to
other ranks' experts are left out of the sorted list, so they cost no tile and add zero.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, inter_ptr, pairs_ptr, block_expert_ptr,
    num_pairs, num_experts, H, inter,
    x_stride, w_se, w_sn, w_sk, inter_stride,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= num_experts:  # a tile past the last expert's padded run
        return
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
    valid = pair < num_pairs  # padding slots hold num_pairs
    token = pair // TOPK
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    w_base = w13_ptr + expert * w_se
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < H
        x = tl.load(x_ptr + token[:, None] * x_stride + offs_k[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        w_mask = k_mask[:, None] & n_mask[None, :]
        w_offs = offs_n[None, :] * w_sn + offs_k[:, None] * w_sk  # [BK, BN]: W^T tile
        w_gate = tl.load(w_base + w_offs, mask=w_mask, other=0.0)
        w_up = tl.load(w_base + inter * w_sn + w_offs, mask=w_mask, other=0.0)
        if UPCAST:  # the interpreter's dot has no bf16; fp32 inputs want exact (not tf32) products
            x, w_gate, w_up = x.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
            acc_gate += tl.dot(x, w_gate, input_precision="ieee")
            acc_up += tl.dot(x, w_up, input_precision="ieee")
        else:
            acc_gate += tl.dot(x, w_gate)
            acc_up += tl.dot(x, w_up)
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    tl.store(inter_ptr + pair[:, None] * inter_stride + offs_n[None, :],
             act.to(inter_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    inter_ptr, w2_ptr, out_ptr, weights_ptr, pairs_ptr, block_expert_ptr,
    num_pairs, num_experts, H, inter,
    inter_stride, w_se, w_sn, w_sk, out_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= num_experts:
        return
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pair < num_pairs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    w_base = w2_ptr + expert * w_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < inter
        a = tl.load(inter_ptr + pair[:, None] * inter_stride + offs_k[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        w = tl.load(w_base + offs_n[None, :] * w_sn + offs_k[:, None] * w_sk,
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BK, BN]
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    weight = tl.load(weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + pair[:, None] * out_stride + offs_n[None, :], acc * weight[:, None],
             mask=valid[:, None] & n_mask[None, :])


def sort_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int, with_absent: bool = False):
    """(sorted_pairs [P], block_expert [P // block_m]): the flat (token, slot) pair indices
    grouped by expert, each expert's run padded with the sentinel T*k to a multiple of block_m,
    and the expert of each block_m tile (num_experts for tiles past the end). P is an upper
    bound computed on the host, so nothing here waits on the device (CUDA-graph safe).

    With `with_absent`, id num_experts marks a pair whose expert is on another rank (expert
    parallel): it gets no slot, so no tile computes it."""
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    buckets = num_experts + 1 if with_absent else num_experts
    # scatter_add, not bincount: bincount sizes its output from the data (a device sync, which
    # a CUDA graph capture of the decode step cannot contain).
    counts = torch.zeros(buckets, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))  # [buckets]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # pairs by expert
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(n, device=flat.device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank_in_expert
    capacity = n + num_experts * (block_m - 1)
    capacity = -(-capacity // block_m) * block_m
    if with_absent:
        # Absent pairs all go to one extra slot past the end, cut off below (no boolean
        # indexing: that would size a tensor from the data, a device sync).
        dest = torch.where(sorted_experts < num_experts, dest, capacity)
    sorted_pairs = torch.full((capacity + with_absent,), n, dtype=torch.int32, device=flat.device)
    sorted_pairs[dest] = order.to(torch.int32)
    sorted_pairs = sorted_pairs[:capacity]
    tile_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end[:num_experts], tile_starts, right=True).to(torch.int32)
    return sorted_pairs, block_expert


def fused_moe(hidden, w13, w2, topk_weights, topk_ids, expert_start=None, block_m=None, block_n=None,
              block_k=None):
    T, H = hidden.shape
    E, two_i, _ = w13.shape
    inter_size = two_i // 2
    k = topk_ids.shape[1]
    assert hidden.stride(1) == 1 and w13.shape[2] == H and w2.shape == (E, H, inter_size)
    if T == 0:
        return torch.empty_like(hidden)
    bm = block_m or (16 if _INTERPRET else 64)
    bn = block_n or (32 if _INTERPRET else 64)
    bk = block_k or 32
    with_absent = expert_start is not None
    if with_absent:  # this rank holds experts [expert_start, expert_start + E); E marks the rest
        local = topk_ids.long() - expert_start
        topk_ids = torch.where((local >= 0) & (local < E), local, E)
    sorted_pairs, block_expert = sort_pairs_by_expert(topk_ids, E, bm, with_absent)
    num_pairs = T * k
    weights = topk_weights.reshape(-1).contiguous()
    upcast = _INTERPRET or hidden.dtype == torch.float32
    inter = torch.empty((num_pairs, inter_size), dtype=hidden.dtype, device=hidden.device)
    tiles = block_expert.numel()
    _gate_up_kernel[(tiles, triton.cdiv(inter_size, bn))](
        hidden, w13, inter, sorted_pairs, block_expert, num_pairs, E, H, inter_size,
        hidden.stride(0), *w13.stride(), inter.stride(0),
        TOPK=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, UPCAST=upcast,
    )
    # Absent pairs are never written by the kernels: their rows must read as zero in the sum.
    out_pairs = (torch.zeros if with_absent else torch.empty)(
        (num_pairs, H), dtype=torch.float32, device=hidden.device)
    _down_kernel[(tiles, triton.cdiv(H, bn))](
        inter, w2, out_pairs, weights, sorted_pairs, block_expert, num_pairs, E, H, inter_size,
        inter.stride(0), *w2.stride(), out_pairs.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, UPCAST=upcast,
    )
    return out_pairs.view(T, k, H).sum(1).to(hidden.dtype)
