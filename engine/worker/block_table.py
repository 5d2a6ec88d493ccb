"""Per-request block ids in a persistent table, and the slot mapping (docs/architecture.md#kernels: slot_mapping)."""

from __future__ import annotations

import numpy as np
import torch

from engine.worker.buffers import StagedBuffer


class BlockTable:
    """Rows are batch slots; each row lists a request's kernel block ids.

    When the allocator's block is larger than the kernel's (block_size = k * kernel_block_size),
    allocation block b becomes kernel blocks [b*k, ..., b*k + k-1]; the KV tensor is viewed
    at kernel granularity, so slots computed from kernel blocks address the same memory.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        block_size: int,
        kernel_block_size: int,
        device: torch.device,
    ) -> None:
        assert block_size % kernel_block_size == 0
        self.blocks_per_alloc_block = block_size // kernel_block_size
        self.kernel_block_size = kernel_block_size
        self.max_blocks = max_num_blocks_per_req * self.blocks_per_alloc_block
        self.table = StagedBuffer((max_num_reqs, self.max_blocks), torch.int32, device)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

    def map_to_kernel_blocks(self, block_ids: list[int]) -> np.ndarray:
        k = self.blocks_per_alloc_block
        ids = np.asarray(block_ids, dtype=np.int32)
        if k == 1:
            return ids
        return (ids[:, None] * k + np.arange(k, dtype=np.int32)[None, :]).reshape(-1)

    def add_row(self, row: int, block_ids: list[int]) -> None:
        self.num_blocks[row] = 0
        self.append_row(row, block_ids)

    def append_row(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        ids = self.map_to_kernel_blocks(block_ids)
        start = self.num_blocks[row]
        end = start + len(ids)
        if end > self.max_blocks:
            raise ValueError(f"request needs {end} kernel blocks, table holds {self.max_blocks}")
        self.table.np[row, start:end] = ids
        self.num_blocks[row] = end

    def move_row(self, src: int, dst: int) -> None:
        n = self.num_blocks[src]
        self.table.np[dst, :n] = self.table.np[src, :n]
        self.num_blocks[dst] = n

    def compute_slot_mapping(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """slot = table[row, pos // kbs] * kbs + pos % kbs, for each (row, position) pair."""
        kbs = self.kernel_block_size
        block_numbers = self.table.np[rows, positions // kbs].astype(np.int64)
        return block_numbers * kbs + positions % kbs


def kv_cache_tensors(num_blocks: int, block_size: int, kernel_block_size: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V caches, [num_kernel_blocks, kernel_block_size, Hkv, D] each."""
    shape = (num_blocks * (block_size // kernel_block_size), kernel_block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
