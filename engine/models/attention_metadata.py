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

    def for_queries(self, rows: torch.Tensor, positions: torch.Tensor) -> AttentionMetadata:
        """The attention of only the step's tokens `rows` [N] (int64, ascending), each as a
        one-token query run over its own request's context up to and including itself (a
        token at position p sees keys [0, p], as it does in the whole step). Writes nothing:
        the slots are those rows' own, for a caller that has already cached the step's K/V."""
        # The request of each row: the number of query runs that end at or before it.
        ends = self.query_start_loc[1:]
        req = torch.searchsorted(ends, rows.to(ends.dtype), right=True)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[rows],
            block_table=self.block_table[req],
            query_start_loc=torch.arange(rows.shape[0] + 1, dtype=torch.int32, device=rows.device),
            seq_lens=(positions[rows] + 1).to(torch.int32),
            max_query_len=1,
            max_seq_len=self.max_seq_len,  # a bound: no kernel needs it exact
            window_group=(None if self.window_group is None
                          else self.window_group.for_queries(rows, positions)),
        )
