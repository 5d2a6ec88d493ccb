"""Structured outputs' token bitmask: the torch reference against a per-token definition,
and the Triton kernel against the reference (TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import reference as ref
from kernels import triton_kernels as tk


def _random_case(num_logits_rows: int, vocab: int, words: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_logits_rows, vocab, generator=g)
    rows = torch.tensor([0, 2, 3][: min(3, num_logits_rows)], dtype=torch.int64)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=g, dtype=torch.int64).to(torch.int32)
    return logits, bitmask, rows


def _allowed_by_definition(bitmask: torch.Tensor, vocab: int) -> np.ndarray:
    """[M, vocab] bool, one token at a time: bit t % 32 of word t // 32 (0 past the words)."""
    words = bitmask.numpy().view(np.uint32)
    out = np.zeros((words.shape[0], vocab), dtype=bool)
    for i in range(words.shape[0]):
        for t in range(min(vocab, 32 * words.shape[1])):
            out[i, t] = (int(words[i, t // 32]) >> (t % 32)) & 1
    return out


@pytest.mark.parametrize("vocab, words", [(96, 3), (100, 4), (70, 2)])
def test_reference_masks_exactly_the_unset_bits(vocab, words):
    logits, bitmask, rows = _random_case(5, vocab, words, seed=vocab)
    before = logits.clone()
    ref.apply_token_bitmask(logits, bitmask, rows)
    allowed = _allowed_by_definition(bitmask, vocab)
    for i, r in enumerate(rows.tolist()):
        ok = torch.from_numpy(allowed[i])
        assert torch.equal(logits[r][ok], before[r][ok])
        assert torch.isneginf(logits[r][~ok]).all()
    untouched = [r for r in range(5) if r not in rows.tolist()]
    assert torch.equal(logits[untouched], before[untouched])


@pytest.mark.parametrize("vocab, words", [(96, 3), (1000, 32), (1030, 32), (2100, 66)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_matches_reference(vocab, words, dtype):
    logits, bitmask, rows = _random_case(4, vocab, words, seed=words)
    logits = logits.to(dtype)
    a, b = logits.clone(), logits.clone()
    ref.apply_token_bitmask(a, bitmask, rows)
    tk.apply_token_bitmask(b, bitmask, rows)
    assert torch.equal(a, b)
