"""LoRA shrink and expand on CPU (contract: kernels.reference.lora_shrink / lora_expand).

A step's adapter tokens are gathered by slot into a padded [groups, width, K] block, so each
projection is one batched matmul per direction whatever the mix of adapters (no Python loop
over requests or adapters). The padding rows are zeros and their results are dropped. The
stacks are read as a view when the step's slots are consecutive (kernels.lora_mapping).
"""

from __future__ import annotations

import torch

import kernels.reference as reference


def _batched(t: torch.Tensor, mapping) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32


def _stack_of(stack: torch.Tensor, mapping) -> torch.Tensor:
    if mapping.slot_range is not None:
        return stack[mapping.slot_range[0]:mapping.slot_range[1]]
    return stack.index_select(0, mapping.slots)


def _padded(x: torch.Tensor, mapping) -> torch.Tensor:
    """The adapter tokens' rows of x as [groups, width, K], zero rows as padding."""
    G, W = mapping.slots.shape[0], mapping.width
    rows = x.index_select(0, mapping.order)
    if G * W == rows.shape[0]:  # no padding: every group is as long as the longest
        return rows.view(G, W, x.shape[1])
    out = x.new_zeros(G * W, x.shape[1])
    out.index_copy_(0, mapping.padded_rows, rows)
    return out.view(G, W, x.shape[1])


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, mapping) -> torch.Tensor:
    """kernels.reference.lora_shrink as one bmm: [G, W, K] x [G, K, R]."""
    if not (_batched(x, mapping) and a_stack.dtype == torch.float32):
        return reference.lora_shrink(x, a_stack, mapping)
    out = x.new_zeros(x.shape[0], a_stack.shape[1])
    if mapping.num_lora_tokens == 0:
        return out
    s = torch.bmm(_padded(x, mapping), _stack_of(a_stack, mapping).transpose(1, 2))  # [G, W, R]
    out.index_copy_(0, mapping.order, s.view(-1, s.shape[2]).index_select(0, mapping.padded_rows))
    return out


def lora_expand(y: torch.Tensor, s: torch.Tensor, b_stack: torch.Tensor, mapping) -> None:
    """kernels.reference.lora_expand as one bmm: [G, W, R] x [G, R, N], added into y's rows."""
    if not (_batched(y, mapping) and s.dtype == b_stack.dtype == torch.float32):
        reference.lora_expand(y, s, b_stack, mapping)
        return
    if mapping.num_lora_tokens == 0:
        return
    d = torch.bmm(_padded(s, mapping), _stack_of(b_stack, mapping).transpose(1, 2))  # [G, W, N]
    y.index_add_(0, mapping.order, d.view(-1, d.shape[2]).index_select(0, mapping.padded_rows))


def lora_apply(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor, mapping) -> None:
    """kernels.reference.lora_apply with the shrink's output kept in the padded layout: two
    bmms, one gather of x's rows and one scatter-add into y's."""
    if not (_batched(x, mapping) and _batched(y, mapping) and a_stack.dtype == b_stack.dtype == torch.float32):
        reference.lora_apply(y, x, a_stack, b_stack, mapping)
        return
    if mapping.num_lora_tokens == 0:
        return
    s = torch.bmm(_padded(x, mapping), _stack_of(a_stack, mapping).transpose(1, 2))  # [G, W, R]
    d = torch.bmm(s, _stack_of(b_stack, mapping).transpose(1, 2))  # [G, W, N]
    d = d.view(-1, d.shape[2])
    if d.shape[0] != mapping.num_lora_tokens:
        d = d.index_select(0, mapping.padded_rows)
    y.index_add_(0, mapping.order, d)
