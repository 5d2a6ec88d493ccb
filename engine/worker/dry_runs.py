"""Forward passes that serve no request: an idle data-parallel core's dummy batch and the
memory-profiling run. Neither touches a real KV block or samples."""

from __future__ import annotations

import torch

from engine.models.attention_metadata import AttentionMetadata


def dummy_forward(model, kv_caches, device: torch.device) -> None:
    """The model on no tokens. It runs every layer, so each MoE layer's expert exchange finds
    this rank there (a dummy batch, docs/parallel.md#waves-and-dummy-batches)."""
    empty = torch.empty(0, dtype=torch.int64, device=device)
    meta = AttentionMetadata(
        slot_mapping=empty, block_table=torch.zeros((0, 1), dtype=torch.int32, device=device),
        query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
        seq_lens=torch.zeros(0, dtype=torch.int32, device=device), max_query_len=0, max_seq_len=0)
    model(empty, empty, kv_caches, meta)


def profile_forward(model, num_tokens: int, kernel_block_size: int, num_kv_heads: int, dtype: torch.dtype,
                    device: torch.device, max_model_len: int, max_num_reqs: int) -> None:
    """One forward pass of `num_tokens` prompt tokens (plus logits for a full batch of
    sequences) against a throwaway KV cache, to measure peak activation memory."""
    a = model.arch
    nb = -(-num_tokens // kernel_block_size)
    shape = (nb, kernel_block_size, num_kv_heads, a.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(a.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        block_table=torch.arange(nb, dtype=torch.int32, device=device).unsqueeze(0),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
    )
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.arange(num_tokens, device=device) % max_model_len
    hidden = model(ids, positions, caches, meta)
    model.compute_logits(hidden[:min(num_tokens, max_num_reqs)])
    del caches, hidden
    if device.type == "cuda":
        torch.cuda.synchronize()
