"""The worker side's host memory: KV blocks copied out of the paged cache, keyed by their
chained block hash (engine.kv_cache.hashing), bounded in bytes, least recently used first out.

Each entry keeps what it takes to refuse bytes that are not what was stored: its shape, its
dtype and a crc32 of its bytes, taken when it was copied out and checked before any of it is
copied back. Host memory can be corrupted, and a block loaded wrong would make every later
token of the request wrong without any error; a refused block costs a recompute instead.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from dataclasses import dataclass

import torch


class RefusedBlock(Exception):
    """A block that cannot be loaded: missing, or its bytes no longer match their checksum,
    shape or dtype. Nothing of it has been written into the cache."""


@dataclass(frozen=True)
class HostBlock:
    data: torch.Tensor  # [layers, 2, block_size, Hkv, D], host memory
    crc32: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def checksum(data: torch.Tensor) -> int:
    """crc32 of a host tensor's bytes (zlib's runs at about a memcpy's speed)."""
    return zlib.crc32(data.reshape(-1).view(torch.uint8).numpy())


class PagedBlocks:
    """The paged cache seen as whole allocation blocks: each layer's K and V as
    [num_blocks, block_size, Hkv, D], whatever the kernels' page size (kernel blocks tile an
    allocation block contiguously, kvstore.kv_io)."""

    def __init__(self, kv_caches: list, block_size: int) -> None:
        self.layers = [(k.view(-1, block_size, *k.shape[2:]), v.view(-1, block_size, *v.shape[2:]))
                       for k, v in kv_caches]
        k0 = self.layers[0][0]
        self.block_shape = (len(self.layers), 2, *k0.shape[1:])  # [layers, 2, block_size, Hkv, D]
        self.dtype = k0.dtype
        self.device = k0.device
        self.block_bytes = k0[0].numel() * k0.element_size() * 2 * len(self.layers)

    def copy_out(self, block_id: int) -> torch.Tensor:
        """One block's KV in host memory (pinned on CUDA, so the copy is a plain DMA). On CUDA
        the copy is asynchronous: `synchronize` before reading it."""
        cuda = self.device.type == "cuda"
        out = torch.empty(self.block_shape, dtype=self.dtype, pin_memory=cuda)
        for i, (k, v) in enumerate(self.layers):
            out[i, 0].copy_(k[block_id], non_blocking=cuda)
            out[i, 1].copy_(v[block_id], non_blocking=cuda)
        return out

    def synchronize(self) -> None:
        """Wait for the copies out started so far (one wait per step, not one per layer)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def copy_in(self, block_id: int, data: torch.Tensor) -> None:
        for i, (k, v) in enumerate(self.layers):
            k[block_id].copy_(data[i, 0], non_blocking=True)
            v[block_id].copy_(data[i, 1], non_blocking=True)


class HostPool:
    """Blocks by hash, at most `capacity_bytes` in all. The scheduler side decides what is
    stored and evicted (it keeps the same LRU order over the same bound, so this pool never
    has to evict on its own); the bound here is the backstop that keeps memory bounded even if
    the two ever disagree, and such an eviction is counted."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.bytes_held = 0
        self.self_evictions = 0
        self._blocks: OrderedDict[bytes, HostBlock] = OrderedDict()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, block_hash: bytes, data: torch.Tensor) -> None:
        block = HostBlock(data, checksum(data), tuple(data.shape), data.dtype)
        self.drop(block_hash)
        while self._blocks and self.bytes_held + block.nbytes > self.capacity_bytes:
            self.drop(next(iter(self._blocks)))
            self.self_evictions += 1
        if block.nbytes > self.capacity_bytes:
            return  # larger than the whole pool: never held
        self._blocks[block_hash] = block
        self.bytes_held += block.nbytes

    def drop(self, block_hash: bytes) -> None:
        block = self._blocks.pop(block_hash, None)
        if block is not None:
            self.bytes_held -= block.nbytes

    def get(self, block_hash: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The block's bytes, checked against what was stored and what the cache expects;
        RefusedBlock otherwise."""
        block = self._blocks.get(block_hash)
        if block is None:
            raise RefusedBlock("not in the host pool")
        if block.shape != tuple(shape) or tuple(block.data.shape) != block.shape:
            raise RefusedBlock(f"shape {tuple(block.data.shape)}, the cache's block is {tuple(shape)}")
        if block.dtype != dtype or block.data.dtype != dtype:
            raise RefusedBlock(f"dtype {block.data.dtype}, the cache holds {dtype}")
        if checksum(block.data) != block.crc32:
            raise RefusedBlock("its bytes no longer match their crc32")
        self._blocks.move_to_end(block_hash)
        return block.data
