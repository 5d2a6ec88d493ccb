"""Structured outputs' token bitmask applied to the logits in place (one program per mask
row and block of the vocabulary)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, logits_stride, bitmask_ptr, bitmask_stride, rows_ptr,
                                vocab_size, num_words, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + i)
    word_idx = offs // 32
    words = tl.load(bitmask_ptr + i * bitmask_stride + word_idx, mask=word_idx < num_words, other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    # Only the masked-out entries are written: an allowed logit keeps its exact value.
    tl.store(logits_ptr + row * logits_stride + offs, tl.full([BLOCK], float("-inf"), tl.float32),
             mask=(offs < vocab_size) & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Same contract as kernels.reference.apply_token_bitmask."""
    assert logits.dim() == 2 and logits.stride(1) == 1
    assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and rows.numel() == bitmask.shape[0]
    M, W = bitmask.shape
    if M == 0:
        return
    V = logits.shape[1]
    block = 1024
    _apply_token_bitmask_kernel[(M, triton.cdiv(V, block))](
        logits, logits.stride(0), bitmask, bitmask.stride(0), rows, V, W, BLOCK=block)
