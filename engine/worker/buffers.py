"""A CPU staging buffer paired with its device tensor (vLLM's CpuGpuBuffer)."""

from __future__ import annotations

import numpy as np
import torch


class StagedBuffer:
    """Host memory (pinned on CUDA, so copies can be non-blocking DMAs) plus a device
    tensor. Inputs are built in `np` and sent with `to_device(n)`. On a CPU device the two
    are the same tensor and nothing is copied."""

    def __init__(self, shape: tuple[int, ...] | int, dtype: torch.dtype, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
        self.np: np.ndarray = self.cpu.numpy()
        self.device_tensor = torch.zeros(shape, dtype=dtype, device=device) if on_cuda else self.cpu

    def to_device(self, n: int | None = None) -> torch.Tensor:
        if self.device_tensor is self.cpu:
            return self.cpu if n is None else self.cpu[:n]
        if n is None:
            return self.device_tensor.copy_(self.cpu, non_blocking=True)
        return self.device_tensor[:n].copy_(self.cpu[:n], non_blocking=True)
