"""The sparse MoE block that replaces the MLP in Mixtral and Qwen3-MoE layers.

A router (one linear layer, no bias) scores every expert per token; softmax in fp32 over all
experts, keep the top k, and renormalise those k to sum to one when the config asks
(Mixtral always does; Qwen3-MoE when norm_topk_prob). The experts are SwiGLU MLPs whose
weights are stacked at load into w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I],
the layout `ops.fused_moe` takes.

Under tensor parallelism every rank holds every expert but only its slice of each expert's
intermediate dim (w13 column-parallel, w2 row-parallel, like the dense MLP); the router is
replicated, so every rank routes identically, and the partial outputs are all-reduced.

Under expert parallelism (ep.size > 1) rank r holds experts [r*E/ep, (r+1)*E/ep) whole. Each
rank routes its own tokens, every rank receives all ranks' tokens with their routing
(`ep.gather_tokens`), computes its experts' share of every token, and `ep.combine` returns each
rank its own tokens summed over all ranks: every (token, expert) pair is computed on exactly
the one rank that holds the expert.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from engine.distributed import SINGLE_EP, SINGLE_RANK, EPGroup, TPGroup
from engine.models.parallel import ShardLayout


class SparseMoE(nn.Module):
    def __init__(self, layout: ShardLayout, ops: SimpleNamespace, tp: TPGroup = SINGLE_RANK,
                 ep: EPGroup = SINGLE_EP) -> None:
        super().__init__()
        arch = layout.arch
        E, H, inter = layout.num_local_experts, arch.hidden_size, layout.moe_intermediate_size
        self.gate = nn.Linear(H, arch.num_experts, bias=False)  # the router, over all experts
        self.w13 = nn.Parameter(torch.empty(E, 2 * inter, H))
        self.w2 = nn.Parameter(torch.empty(E, H, inter))
        self.top_k = arch.num_experts_per_tok
        self.renormalize = arch.norm_topk_prob
        self.ops = ops
        self.tp = tp
        self.ep = ep
        self.expert_start = layout.expert_start

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k]) of each token."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H]
        if self.ep.size > 1:
            return self._forward_expert_parallel(x)
        weights, ids = self.route(x)
        out = self.ops.fused_moe(x, self.w13, self.w2, weights, ids)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)

    def _forward_expert_parallel(self, x: torch.Tensor) -> torch.Tensor:
        T, H = x.shape
        tp = self.tp
        # The TP ranks of one data-parallel rank hold the same T tokens: each sends only its
        # share into the exchange, so every token reaches each of its experts once. A rank
        # with no tokens (an idle rank's dummy step) still joins both collectives.
        lo, hi = T * tp.rank // tp.size, T * (tp.rank + 1) // tp.size
        mine = x[lo:hi]
        weights, ids = self.route(mine)
        gathered, sizes = self.ep.gather_tokens(pack_routed_tokens(mine, weights, ids))
        gx, gweights, gids = unpack_routed_tokens(gathered, x.dtype, H)
        y = self.ops.fused_moe(gx, self.w13, self.w2, gweights, gids, expert_start=self.expert_start)
        out = self.ep.combine(y, sizes)  # [hi - lo, H]
        if tp.size == 1:
            return out
        # Put the shares back together: every row is one rank's share plus zeros (exact).
        full = x.new_zeros(T, H)
        full[lo:hi] = out
        return tp.all_reduce(full)


def pack_routed_tokens(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One uint8 row per token: x's bytes, its routing weights' (fp32) and expert ids' (int32),
    so the tokens and their routing cross ranks in one all-gather (not three)."""
    parts = (x.contiguous(), weights.float().contiguous(), ids.to(torch.int32).contiguous())
    return torch.cat([p.view(torch.uint8) for p in parts], dim=1)  # [T, H*s + 8k]


def unpack_routed_tokens(rows: torch.Tensor, dtype: torch.dtype, hidden_size: int):
    """Inverse of pack_routed_tokens: (x [N, H] dtype, weights [N, k] fp32, ids [N, k] int32)."""
    xb = hidden_size * dtype.itemsize
    k = (rows.shape[1] - xb) // 8
    # The hidden states are a strided view (no copy); routing is small enough to copy.
    x = rows[:, :xb].view(dtype)
    weights = rows[:, xb:xb + 4 * k].contiguous().view(torch.float32)
    ids = rows[:, xb + 4 * k:].contiguous().view(torch.int32)
    return x, weights, ids
