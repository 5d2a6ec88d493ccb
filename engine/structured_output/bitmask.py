"""Worker side: the scheduler's grammar bitmask, lined up with the rows the sampler sees."""

from __future__ import annotations

import numpy as np
import torch


def bitmask_for_sampled_rows(row_of: dict[str, int], bitmask: np.ndarray, sampled_req_ids: list[str],
                             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [M, words] int32, logits row of each [M] int64) for the sampled requests that
    have a mask row; `row_of` maps a request id to its row in `bitmask` (SchedulerOutput)."""
    pairs = [(j, row_of[r]) for j, r in enumerate(sampled_req_ids) if r in row_of]
    logits_rows = torch.tensor([j for j, _ in pairs], dtype=torch.int64)
    mask = torch.from_numpy(np.ascontiguousarray(bitmask[[k for _, k in pairs]]))
    return mask.to(device), logits_rows.to(device)
