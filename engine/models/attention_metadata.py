"""Per-step attention inputs shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 = padding
    block_table: torch.Tensor  # [R, max_blocks] int32 (kernel blocks)
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    max_query_len: int
    max_seq_len: int
    # A hybrid model's sliding-window layers read and write their own group's blocks
    # (engine.kv_cache.manager): its slots and table, the same queries and lengths.
    window_group: AttentionMetadata | None = None
