"""The sparse MoE block that replaces the MLP in Mixtral and Qwen3-MoE layers.

A router (one linear layer, no bias) scores every expert per token; softmax in fp32 over all
experts, keep the top k, and renormalise those k to sum to one when the config asks
(Mixtral always does; Qwen3-MoE when norm_topk_prob). The experts are SwiGLU MLPs whose
weights are stacked at load into w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I],
the layout `ops.fused_moe` takes.

Under tensor parallelism every rank holds every expert but only its slice of each expert's
intermediate dim (w13 column-parallel, w2 row-parallel, like the dense MLP); the router is
replicated, so every rank routes identically, and the partial outputs are all-reduced.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from engine.distributed import SINGLE_RANK, TPGroup
from engine.models.parallel import ShardLayout


class SparseMoE(nn.Module):
    def __init__(self, layout: ShardLayout, ops: SimpleNamespace, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        arch = layout.arch
        E, H, inter = arch.num_experts, arch.hidden_size, layout.moe_intermediate_size
        self.gate = nn.Linear(H, E, bias=False)  # the router
        self.w13 = nn.Parameter(torch.empty(E, 2 * inter, H))
        self.w2 = nn.Parameter(torch.empty(E, H, inter))
        self.top_k = arch.num_experts_per_tok
        self.renormalize = arch.norm_topk_prob
        self.ops = ops
        self.tp = tp

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k]) of each token."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H]
        weights, ids = self.route(x)
        out = self.ops.fused_moe(x, self.w13, self.w2, weights, ids)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)
