"""Copy one request's KV out of, and into, the paged cache.

The caches may be viewed at kernel-block granularity, but kernel blocks tile allocation blocks
contiguously, so a flat [num_slots, Hkv, D] view addresses token p of a request at
block_ids[p // block_size] * block_size + p % block_size whatever the kernel page size.
"""

from __future__ import annotations

import torch


def request_slots(block_ids: list[int], start: int, end: int, block_size: int, device) -> torch.Tensor:
    pos = torch.arange(start, end)
    blocks = torch.tensor(block_ids, dtype=torch.int64)[pos // block_size]
    return (blocks * block_size + pos % block_size).to(device)


def gather_kv(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int], num_tokens: int,
              block_size: int) -> torch.Tensor:
    """KV of tokens [0, num_tokens) as one tensor [layers, 2, num_tokens, Hkv, D]."""
    k0 = kv_caches[0][0]
    slots = request_slots(block_ids, 0, num_tokens, block_size, k0.device)
    out = torch.empty((len(kv_caches), 2, num_tokens, *k0.shape[2:]), dtype=k0.dtype, device=k0.device)
    for layer, (k, v) in enumerate(kv_caches):
        out[layer, 0] = k.view(-1, *k.shape[2:]).index_select(0, slots)
        out[layer, 1] = v.view(-1, *v.shape[2:]).index_select(0, slots)
    return out


def scatter_kv(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int], start: int, end: int,
               block_size: int, kv: torch.Tensor) -> None:
    """Write kv[:, :, start:end] (tokens start..end-1 of the request) into its blocks."""
    k0 = kv_caches[0][0]
    if kv.shape[0] != len(kv_caches) or tuple(kv.shape[3:]) != tuple(k0.shape[2:]):
        raise ValueError(f"KV of shape {tuple(kv.shape)} does not fit caches of {len(kv_caches)} layers "
                         f"x {tuple(k0.shape[2:])}")
    if kv.shape[2] < end:
        raise ValueError(f"KV holds {kv.shape[2]} tokens, {end} are needed")
    slots = request_slots(block_ids, start, end, block_size, k0.device)
    part = kv[:, :, start:end].to(device=k0.device, dtype=k0.dtype)
    for layer, (k, v) in enumerate(kv_caches):
        k.view(-1, *k.shape[2:]).index_copy_(0, slots, part[layer, 0])
        v.view(-1, *v.shape[2:]).index_copy_(0, slots, part[layer, 1])
