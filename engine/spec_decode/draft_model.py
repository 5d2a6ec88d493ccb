"""Draft-model proposer: a smaller model with the target's vocabulary guesses k tokens.

The draft keeps its own KV cache, indexed by the same block ids as the target's (one block
table serves both), so the scheduler's allocation, prefix-cache hits and preemption apply to
it unchanged. Every step it runs on the same flattened batch as the target (prefill chunks,
verified drafts and all), which keeps its KV in step; then it decodes k tokens greedily per
request into the lookahead slots the scheduler reserved.

Greedy drafts are a deterministic function of the context, so their q is one-hot and the
rejection sampler's n-gram rule (accept with probability p(d)) is exact for them.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from engine.distributed import SINGLE_RANK
from engine.models.arch import load_arch
from engine.models.attention_metadata import AttentionMetadata
from engine.models.loader import load_model
from engine.worker.block_table import BlockTable


class DraftModelProposer:
    def __init__(self, model_dir: str, num_speculative_tokens: int, ops: SimpleNamespace, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, block_size: int, kernel_block_size: int) -> None:
        self.k = num_speculative_tokens
        self.arch = load_arch(model_dir)
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.kernel_block_size = kernel_block_size
        self.model = load_model(model_dir, self.arch, ops, device, dtype, max_model_len, SINGLE_RANK)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def kv_bytes_per_block(self) -> int:
        a = self.arch
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * a.num_layers * self.block_size * self.model.layout.num_kv_heads * a.head_dim * itemsize

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """[num_kernel_blocks, kernel_block_size, Hkv, D] K and V per draft layer."""
        shape = (num_blocks * (self.block_size // self.kernel_block_size), self.kernel_block_size,
                 self.model.layout.num_kv_heads, self.arch.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(self.arch.num_layers)]

    def run_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Write the draft's KV for the target's step inputs (same slots, same tokens)."""
        self.model(input_ids, positions, self.kv_caches, meta)

    def propose(self, block_table: BlockTable, rows: np.ndarray, last_tokens: np.ndarray,
                last_positions: np.ndarray, limits: np.ndarray) -> list[list[int]]:
        """k greedy drafts per request: rows [M] block-table rows, last_tokens [M] each
        request's newest token at last_positions [M]; a draft step only runs where its input
        position is below limits [M] (max_model_len, or the end of the reserved slots)."""
        out: list[list[int]] = [[] for _ in rows]
        tokens = last_tokens.astype(np.int64)
        pos = last_positions.astype(np.int64)
        active = np.arange(len(rows))
        kbs = self.kernel_block_size
        for _ in range(self.k):
            active = active[pos[active] < limits[active]]
            if not len(active):
                break
            R = len(active)
            seq_lens = pos[active] + 1
            nb = -(-int(seq_lens.max()) // kbs)
            meta = AttentionMetadata(
                slot_mapping=torch.from_numpy(block_table.compute_slot_mapping(rows[active], pos[active])).to(self.device),
                block_table=torch.from_numpy(np.ascontiguousarray(block_table.table.np[rows[active], :nb])).to(self.device),
                query_start_loc=torch.arange(R + 1, dtype=torch.int32, device=self.device),
                seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(self.device),
                max_query_len=1,
                max_seq_len=int(seq_lens.max()),
            )
            hidden = self.model(torch.from_numpy(tokens[active]).to(self.device),
                                torch.from_numpy(pos[active]).to(self.device), self.kv_caches, meta)  # [R, hidden]
            nxt = self.model.compute_logits(hidden).argmax(dim=-1).cpu().numpy()  # [R]
            for j, a in enumerate(active):
                out[a].append(int(nxt[j]))
            tokens[active] = nxt
            pos[active] += 1
        return out
