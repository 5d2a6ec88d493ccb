"""Adapter slots on the model's projections, and the per-step delta they add.

Each adaptable projection (qkv_proj, o_proj, gate_up_proj, down_proj of every decoder layer)
gets a `LoRAStack`: A [max_loras, slices * max_rank, in] and B [max_loras, out, slices *
max_rank], one slot per resident adapter. Slice j of a fused projection (q, k, v; gate, up)
owns A's rows [j * max_rank, j * max_rank + r) and writes B's output rows of its module, so
one shrink and one expand cover the fused projection (B is block-diagonal; the zeros cost
little at LoRA ranks). A step's adapters reach every stack through one shared `LoRAContext`.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from engine.lora.config import LoRAConfig
from engine.lora.peft import NUM_SLICES, LoRAAdapter


class LoRAContext:
    """The step's kernels.lora_mapping.LoRAMapping, or None when no token uses an adapter
    (then the projections skip LoRA entirely)."""

    mapping = None


class LoRAStack:
    def __init__(self, proj: str, in_features: int, out_features: int, config: LoRAConfig, ctx: LoRAContext,
                 ops: SimpleNamespace, device: torch.device, dtype: torch.dtype) -> None:
        self.rank = config.max_lora_rank
        width = NUM_SLICES[proj] * self.rank
        self.a = torch.zeros(config.max_loras, width, in_features, dtype=dtype, device=device)  # [L, S*r, in]
        self.b = torch.zeros(config.max_loras, out_features, width, dtype=dtype, device=device)  # [L, out, S*r]
        self.ctx = ctx
        self.ops = ops

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (x's base projection, [T, out]) plus each token's adapter delta, in place."""
        mapping = self.ctx.mapping
        if mapping is not None:
            self.ops.lora_apply(y, x, self.a, self.b, mapping)
        return y

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def write(self, slot: int, slices) -> None:
        """Slot `slot` := an adapter's slices of this projection (peft.LoRAAdapter.weights)."""
        self.clear(slot)
        for target, a, b in slices:
            r = a.shape[0]
            cols = slice(target.index * self.rank, target.index * self.rank + r)
            self.a[slot, cols] = a.to(self.a.dtype)
            self.b[slot, target.out_start:target.out_start + target.out_len, cols] = b.to(self.b.dtype)


def adaptable_projections(model: nn.Module):
    """(layer index, projection name, the linear module) for every projection LoRA can adapt
    (an MoE layer's experts are not)."""
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        yield i, "qkv_proj", attn.qkv_proj
        yield i, "o_proj", attn.o_proj
        if hasattr(mlp, "gate_up_proj"):
            yield i, "gate_up_proj", mlp.gate_up_proj
            yield i, "down_proj", mlp.down_proj


def attach_lora(model: nn.Module, config: LoRAConfig, ops: SimpleNamespace, device: torch.device,
                dtype: torch.dtype) -> tuple[LoRAContext, dict[tuple[int, str], LoRAStack]]:
    """Give every adaptable projection its stack (the projection adds the delta in forward)."""
    ctx = LoRAContext()
    stacks = {}
    for i, proj, linear in adaptable_projections(model):
        stack = LoRAStack(proj, linear.in_features, linear.out_features, config, ctx, ops, device, dtype)
        linear.lora = stack
        stacks[(i, proj)] = stack
    return ctx, stacks


def write_adapter(stacks: dict[tuple[int, str], LoRAStack], slot: int, adapter: LoRAAdapter) -> None:
    for key, stack in stacks.items():
        slices = adapter.weights.get(key)
        if slices:
            stack.write(slot, slices)
        else:
            stack.clear(slot)
