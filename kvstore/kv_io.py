"""Copy one request's KV out of, and into, the paged cache, and refuse KV that is not what its
transfer says it is.

The caches may be viewed at kernel-block granularity, but kernel blocks tile allocation blocks
contiguously, so a flat [num_slots, Hkv, D] view addresses token p of a request at
block_ids[p // block_size] * block_size + p % block_size whatever the kernel page size.

A transfer is token-major, [layers, 2, num_tokens, Hkv, D] in the cache's dtype, so it does
not depend on either side's block size. What the consumer knows before it writes anything:
the transfer's params (num_tokens) and its own caches (layers, heads, head size, dtype);
`check_kv` holds the bytes to both. The transports that move bytes across a process check
them against the meta that travels with them (byte count and `kv_crc32`).
"""

from __future__ import annotations

import zlib

import torch

# Why a transfer is refused (the label of pdserve:kv_transfer_refused_total): fewer or more
# tokens than its params say; another number of layers; a layout of blocks instead of tokens;
# other heads or head size (or not a [layers, 2, tokens, heads, head_dim] tensor at all);
# another dtype (never cast: the prefill ran another model or precision); bytes that do not
# match their meta (byte count or crc32, checked where they crossed a process).
REFUSAL_REASONS = ("tokens", "layers", "block_size", "shape", "dtype", "bytes")


def refusal_key(reason: str) -> str:
    """The P/D connector's counter of refusals for `reason` (its transfer_stats)."""
    return f"refused_{reason}"


class MalformedKV(Exception):
    """KV refused before anything was written into the cache; `reason` is one of
    REFUSAL_REASONS. The load then fails, and the failure policy applies."""

    def __init__(self, reason: str, message: str) -> None:
        if reason not in REFUSAL_REASONS:
            raise ValueError(f"reason must be one of {REFUSAL_REASONS}, got {reason!r}")
        super().__init__(reason, message)
        self.reason = reason
        self.message = message

    def __str__(self) -> str:
        return f"malformed KV ({self.reason}): {self.message}"


def kv_crc32(kv: torch.Tensor) -> int:
    """crc32 of a host tensor's bytes in memory order (zlib's: about a memcpy's speed, and it
    lets other threads run)."""
    raw = kv.contiguous().reshape(-1).view(torch.uint8)
    return zlib.crc32(raw.numpy()) if raw.numel() else 0


def check_bytes(kv: torch.Tensor, nbytes: int | None, crc32: int | None, where: str) -> None:
    """Raise MalformedKV("bytes") unless a host tensor that crossed `where` has the byte count
    and crc32 its producer sent beside it (None: not sent)."""
    got = kv.numel() * kv.element_size()
    if nbytes is not None and got != nbytes:
        raise MalformedKV("bytes", f"KV from {where} has {got} bytes, its meta says {nbytes}")
    if crc32 is not None and kv_crc32(kv) != crc32:
        raise MalformedKV("bytes", f"KV bytes from {where} do not match their crc32 ({crc32:#010x})")


def check_kv(kv: object, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_tokens: int) -> None:
    """Raise MalformedKV unless `kv` is a whole transfer of `num_tokens` tokens for these
    caches: [layers, 2, num_tokens, Hkv, D] in their dtype (any device: it is copied over)."""
    k0 = kv_caches[0][0]
    check_kv_layout(kv, len(kv_caches), tuple(k0.shape[2:]), k0.dtype, num_tokens)


def check_kv_layout(kv: object, layers: int, heads: tuple[int, ...], dtype: torch.dtype, num_tokens: int) -> None:
    """Raise MalformedKV unless `kv` is [layers, 2, num_tokens, *heads] in `dtype`; `heads` is
    (kv heads, head size) of a cache, or of one producer rank's shard (kvstore.reshard)."""
    heads = tuple(heads)
    want = f"[{layers}, 2, {num_tokens}, {', '.join(map(str, heads))}] {str(dtype).removeprefix('torch.')}"
    if not isinstance(kv, torch.Tensor):
        raise MalformedKV("shape", f"got a {type(kv).__name__}, not a tensor {want}")
    shape = tuple(kv.shape)
    if len(shape) == 6 and shape[:2] == (layers, 2) and shape[4:] == heads:
        # [layers, 2, blocks, block_size, Hkv, D]: a producer's blocks, not its tokens.
        raise MalformedKV("block_size", f"KV of shape {list(shape)} is laid out in blocks of {shape[3]} "
                                        f"tokens; a transfer is token-major, {want}")
    if len(shape) != 5 or shape[1] != 2:
        raise MalformedKV("shape", f"KV of shape {list(shape)} is not [layers, 2, tokens, kv_heads, "
                                   f"head_dim]; this cache takes {want}")
    if shape[0] != layers:
        raise MalformedKV("layers", f"KV of {shape[0]} layers, this cache has {layers} ({want})")
    if shape[3:] != heads:
        raise MalformedKV("shape", f"KV heads x head size {list(shape[3:])}, this cache has {list(heads)} ({want})")
    if shape[2] != num_tokens:
        raise MalformedKV("tokens", f"KV of {shape[2]} tokens, its transfer has {num_tokens} ({want})")
    if kv.dtype != dtype:
        raise MalformedKV("dtype", f"KV in {str(kv.dtype).removeprefix('torch.')}, this cache in "
                                   f"{str(dtype).removeprefix('torch.')} (never cast: {want})")


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
               block_size: int, kv: torch.Tensor, num_tokens: int, layer_groups: list[int] | None = None) -> None:
    """Write kv[:, :, start:end] (tokens start..end-1 of the request) into its blocks (per
    group, as gather_kv), once `check_kv` accepted `kv` as a transfer of `num_tokens` tokens:
    a refused one writes nothing."""
    check_kv(kv, kv_caches, num_tokens)
    if not 0 <= start <= end <= num_tokens:  # the scheduler's span: never past the transfer
        raise ValueError(f"tokens [{start}, {end}) asked of a transfer of {num_tokens}")
    k0 = kv_caches[0][0]
    slots = _layer_slots(block_ids, layer_groups, len(kv_caches), start, end, block_size, k0.device)
    part = kv[:, :, start:end].to(device=k0.device)
    for layer, (k, v) in enumerate(kv_caches):
        k.view(-1, *k.shape[2:]).index_copy_(0, slots[layer], part[layer, 0])
        v.view(-1, *v.shape[2:]).index_copy_(0, slots[layer], part[layer, 1])
