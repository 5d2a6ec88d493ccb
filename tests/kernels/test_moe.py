"""fused_moe: the torch reference against a per-token loop, and the Triton kernel against the
reference (under TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import reference as ref
from kernels import triton_kernels as tk
from kernels.triton_kernels.moe import sort_pairs_by_expert

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _moe_case(T, H, inter, E, k, dtype, seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=g) / inter**0.5).to(dtype)
    logits = torch.randn(T, E, generator=g)
    if skew:  # most tokens pick expert 0: one long run and some experts with no tokens
        logits[:, 0] += 5.0
        logits[:, E - 1] -= 20.0
    weights, ids = torch.softmax(logits, -1).topk(k, -1)
    return hidden, w13, w2, weights / weights.sum(-1, keepdim=True), ids


def test_reference_equals_a_per_token_loop():
    hidden, w13, w2, weights, ids = _moe_case(9, 24, 16, 5, 2, torch.float64)
    inter = w13.shape[1] // 2
    expected = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = w13[e, :inter] @ hidden[t], w13[e, inter:] @ hidden[t]
            expected[t] += weights[t, j].double() * (w2[e] @ (F.silu(gate) * up))
    torch.testing.assert_close(ref.fused_moe(hidden, w13, w2, weights, ids), expected)


def test_reference_routes_each_token_only_to_its_experts():
    hidden, w13, w2, weights, ids = _moe_case(6, 16, 8, 4, 1, torch.float32, seed=1)
    before = ref.fused_moe(hidden, w13, w2, weights, ids)
    unused = sorted(set(range(4)) - set(ids.flatten().tolist()))
    w13[unused] = 1e3  # an expert no token picked must not contribute
    torch.testing.assert_close(ref.fused_moe(hidden, w13, w2, weights, ids), before)


def test_sorted_pairs_put_one_expert_in_each_tile_and_every_pair_once():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 2], [2, 0]])
    pairs, block_expert = sort_pairs_by_expert(ids, num_experts=5, block_m=4)
    flat, n = ids.flatten(), ids.numel()
    assert sorted(p for p in pairs.tolist() if p < n) == list(range(n))
    for tile, expert in enumerate(block_expert.tolist()):
        members = [p for p in pairs[tile * 4:(tile + 1) * 4].tolist() if p < n]
        assert all(int(flat[p]) == expert for p in members)
        assert expert < 5 or not members  # tiles past the last run are empty


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, H, inter, E, k, skew", [
    (7, 64, 32, 4, 2, False),  # fewer tokens than a tile
    (40, 48, 40, 8, 2, True),  # sizes not multiples of the tiles, idle experts, a long run
    (5, 32, 32, 6, 3, False),
])
def test_triton_fused_moe_matches_reference(dtype, T, H, inter, E, k, skew):
    hidden, w13, w2, weights, ids = _moe_case(T, H, inter, E, k, dtype, seed=T, skew=skew)
    expected = ref.fused_moe(hidden.float(), w13.float(), w2.float(), weights, ids)
    got = tk.fused_moe(hidden, w13, w2, weights, ids)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


def test_triton_fused_moe_with_no_tokens():
    hidden, w13, w2, weights, ids = _moe_case(0, 32, 16, 4, 2, torch.float32)
    assert tk.fused_moe(hidden, w13, w2, weights, ids).shape == (0, 32)
