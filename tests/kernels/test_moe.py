"""fused_moe: the torch reference against a per-token loop, and the Triton kernel against the
reference (under TRITON_INTERPRET=1 on CPU); both also with one expert-parallel rank's experts
(`expert_start`), where pairs routed to other ranks' experts contribute nothing."""

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


def _per_token_loop(hidden, w13, w2, weights, ids, experts):
    """sum over each token's slots whose expert is in `experts` (global ids); w13/w2 hold
    exactly those experts, in order."""
    inter = w13.shape[1] // 2
    local = {e: i for i, e in enumerate(experts)}
    expected = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            e = local.get(int(ids[t, j]))
            if e is None:
                continue
            x = hidden[t].double()
            gate, up = w13[e, :inter].double() @ x, w13[e, inter:].double() @ x
            expected[t] += weights[t, j].double() * (w2[e].double() @ (F.silu(gate) * up))
    return expected


def test_reference_equals_a_per_token_loop():
    hidden, w13, w2, weights, ids = _moe_case(9, 24, 16, 5, 2, torch.float64)
    expected = _per_token_loop(hidden, w13, w2, weights, ids, range(5))
    torch.testing.assert_close(ref.fused_moe(hidden, w13, w2, weights, ids), expected)


@pytest.mark.parametrize("start, count", [(0, 2), (2, 2), (4, 2)])
def test_reference_with_expert_start_computes_only_the_local_experts(start, count):
    hidden, w13, w2, weights, ids = _moe_case(9, 24, 16, 6, 2, torch.float64, seed=2)
    local = range(start, start + count)
    expected = _per_token_loop(hidden, w13[start:start + count], w2[start:start + count], weights, ids, local)
    got = ref.fused_moe(hidden, w13[start:start + count], w2[start:start + count], weights, ids,
                        expert_start=start)
    torch.testing.assert_close(got, expected)


def test_expert_parallel_shares_sum_to_the_whole():
    # Every (token, expert) pair is computed on exactly one rank: the ranks' outputs add up.
    hidden, w13, w2, weights, ids = _moe_case(11, 16, 8, 8, 3, torch.float64, seed=3)
    shares = [ref.fused_moe(hidden, w13[s:s + 2], w2[s:s + 2], weights, ids, expert_start=s)
              for s in range(0, 8, 2)]
    torch.testing.assert_close(sum(shares), ref.fused_moe(hidden, w13, w2, weights, ids))


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


def test_sorted_pairs_leave_out_pairs_of_absent_experts():
    ids = torch.tensor([[2, 0], [1, 2], [0, 2], [1, 0]])  # local ids; 2 = absent (2 local experts)
    pairs, block_expert = sort_pairs_by_expert(ids, num_experts=2, block_m=4, with_absent=True)
    flat, n = ids.flatten(), ids.numel()
    placed = sorted(p for p in pairs.tolist() if p < n)
    assert placed == [p for p in range(n) if int(flat[p]) < 2]
    for tile, expert in enumerate(block_expert.tolist()):
        members = [p for p in pairs[tile * 4:(tile + 1) * 4].tolist() if p < n]
        assert all(int(flat[p]) == expert for p in members)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, E, start, count, skew", [
    (7, 4, 0, 2, False),  # the first rank's experts
    (20, 8, 6, 2, True),  # the last rank's, where the skew leaves expert 7 with no tokens
    (5, 6, 3, 3, False),
])
def test_triton_fused_moe_with_expert_start_matches_reference(dtype, T, E, start, count, skew):
    hidden, w13, w2, weights, ids = _moe_case(T, 32, 16, E, 2, dtype, seed=T, skew=skew)
    w13, w2 = w13[start:start + count], w2[start:start + count]
    expected = ref.fused_moe(hidden.float(), w13.float(), w2.float(), weights, ids, expert_start=start)
    got = tk.fused_moe(hidden, w13, w2, weights, ids, expert_start=start)
    torch.testing.assert_close(got.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


def test_triton_fused_moe_with_no_local_pairs_is_zero():
    hidden, w13, w2, weights, ids = _moe_case(6, 32, 16, 4, 1, torch.float32)
    ids = torch.full_like(ids, 3)  # every token picks expert 3; this rank holds 0 and 1
    got = tk.fused_moe(hidden, w13[:2], w2[:2], weights, ids, expert_start=0)
    assert torch.equal(got, torch.zeros_like(hidden))
