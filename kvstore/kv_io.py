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


def _layer_slots(block_ids, layer_groups, num_layers: int, start: int, end: int, block_size: int, device):
    """Each layer's slots of tokens [start, end): from its KV cache group's block ids (a
    hybrid model's window layers have a table of their own, engine.kv_cache.hybrid)."""
    per_group = [request_slots(list(ids), start, end, block_size, device) for ids in block_ids]
    groups = layer_groups or [0] * num_layers
    if max(groups) >= len(per_group):
        raise ValueError(f"layers of {max(groups) + 1} KV cache groups, block ids of {len(per_group)}")
    return [per_group[g] for g in groups]


def gather_kv(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: tuple, num_tokens: int,
              block_size: int, layer_groups: list[int] | None = None) -> torch.Tensor:
    """KV of tokens [0, num_tokens) as one tensor [layers, 2, num_tokens, Hkv, D].
    `block_ids`: one sequence per KV cache group; `layer_groups`: each layer's group."""
    k0 = kv_caches[0][0]
    slots = _layer_slots(block_ids, layer_groups, len(kv_caches), 0, num_tokens, block_size, k0.device)
    out = torch.empty((len(kv_caches), 2, num_tokens, *k0.shape[2:]), dtype=k0.dtype, device=k0.device)
    for layer, (k, v) in enumerate(kv_caches):
        out[layer, 0] = k.view(-1, *k.shape[2:]).index_select(0, slots[layer])
        out[layer, 1] = v.view(-1, *v.shape[2:]).index_select(0, slots[layer])
    return out


def scatter_kv(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: tuple, start: int, end: int,
               block_size: int, kv: torch.Tensor, layer_groups: list[int] | None = None) -> None:
    """Write kv[:, :, start:end] (tokens start..end-1 of the request) into its blocks (per
    group, as gather_kv)."""
    k0 = kv_caches[0][0]
    if kv.shape[0] != len(kv_caches) or tuple(kv.shape[3:]) != tuple(k0.shape[2:]):
        raise ValueError(f"KV of shape {tuple(kv.shape)} does not fit caches of {len(kv_caches)} layers "
                         f"x {tuple(k0.shape[2:])}")
    if kv.shape[2] < end:
        raise ValueError(f"KV holds {kv.shape[2]} tokens, {end} are needed")
    slots = _layer_slots(block_ids, layer_groups, len(kv_caches), start, end, block_size, k0.device)
    part = kv[:, :, start:end].to(device=k0.device, dtype=k0.dtype)
    for layer, (k, v) in enumerate(kv_caches):
        k.view(-1, *k.shape[2:]).index_copy_(0, slots[layer], part[layer, 0])
        v.view(-1, *v.shape[2:]).index_copy_(0, slots[layer], part[layer, 1])
