"""Which adapter each token of a step uses, in the forms the LoRA kernels read.

Punica's idea: one batched product per projection for a batch that mixes adapters, instead of
one product per request. `token_slots` is the whole contract (the references and the Triton
kernels read only it); the grouping below lets the CPU path run each projection as two
batched matmuls over [groups, width] with no loop in Python. It is built once per step on
the host and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LoRAMapping:
    token_slots: torch.Tensor  # [T] int64: the adapter slot of each token, -1 = the base model
    # The tokens that use an adapter, grouped by slot (CPU path):
    order: torch.Tensor  # [n] int64: their rows, sorted by slot (stable)
    slots: torch.Tensor  # [G] int64: the slot of each group, ascending
    padded_rows: torch.Tensor  # [n] int64: each sorted token's row in the padded [G * width] layout
    width: int  # tokens in the largest group
    # (first, last + 1) when the groups' slots are consecutive: the stacks are then read as a
    # view, with no gather of the adapters' weights.
    slot_range: tuple[int, int] | None = None

    @classmethod
    def build(cls, token_slots: np.ndarray, device: torch.device | str = "cpu") -> LoRAMapping:
        """From [T] int slots on the host (-1 = no adapter)."""
        slots_np = np.asarray(token_slots, dtype=np.int64)
        order = np.flatnonzero(slots_np >= 0)
        order = order[np.argsort(slots_np[order], kind="stable")]
        groups, starts, counts = np.unique(slots_np[order], return_index=True, return_counts=True)
        width = int(counts.max()) if len(counts) else 0
        # Token j of the sorted run sits at (its group) * width + (its place in the group).
        group_of = np.repeat(np.arange(len(groups)), counts)
        padded = group_of * width + (np.arange(len(order)) - np.repeat(starts, counts))

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)

        consecutive = len(groups) > 0 and int(groups[-1]) - int(groups[0]) + 1 == len(groups)
        slot_range = (int(groups[0]), int(groups[-1]) + 1) if consecutive else None
        return cls(dev(slots_np), dev(order), dev(groups), dev(padded), width, slot_range)

    @property
    def num_lora_tokens(self) -> int:
        return int(self.order.shape[0])
