"""The model runner's side of multi-LoRA: which request runs which adapter, the device slots
(`max_loras`, evicted least recently used among adapters the step does not need) and the
host cache behind them (`max_cpu_loras`, LRU), and each step's token -> slot mapping.

The scheduler never puts more than `max_loras` adapters in one step (engine.lora.sched), so a
step always finds a slot for each of its adapters.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from engine.lora.config import LoRAConfig
from engine.lora.layers import attach_lora, write_adapter
from engine.lora.peft import LoRAAdapter, load_adapter
from engine.lora.request import LoRARequest
from engine.models.arch import ModelArch
from kernels.lora_mapping import LoRAMapping

logger = logging.getLogger(__name__)


class LoRARunner:
    def __init__(self, model: nn.Module, arch: ModelArch, config: LoRAConfig, ops: SimpleNamespace,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.arch, self.config, self.device = arch, config, device
        self.ctx, self.stacks = attach_lora(model, config, ops, device, dtype)
        self.slot_ids: list[tuple[int, str] | None] = [None] * config.max_loras  # (int id, path) per slot
        self.slot_last_use = [0] * config.max_loras
        self.host: OrderedDict[tuple[int, str], LoRAAdapter] = OrderedDict()  # LRU, oldest first
        self.requests: dict[str, LoRARequest] = {}
        self.steps = 0
        self.loads = 0  # adapters read from disk (host cache misses), for tests and metrics

    def update(self, so) -> None:
        """Track the scheduler output's finished and new requests' adapters."""
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            if new.lora_request is not None:
                self.requests[new.req_id] = new.lora_request
            else:
                self.requests.pop(new.req_id, None)

    @contextmanager
    def step(self, req_ids: list[str], num_scheduled: np.ndarray):
        """Map this step's tokens to slots for the forward pass inside the block."""
        self.steps += 1
        loras = [self.requests.get(r) for r in req_ids]
        needed = {(lr.lora_int_id, lr.lora_path): lr for lr in loras if lr is not None}
        if needed:
            if len(needed) > self.config.max_loras:
                raise RuntimeError(f"a step of {len(needed)} adapters exceeds max_loras={self.config.max_loras}")
            slot_of = {key: self._slot_for(key, lr, needed) for key, lr in needed.items()}
            per_req = np.array([-1 if lr is None else slot_of[(lr.lora_int_id, lr.lora_path)] for lr in loras])
            self.ctx.mapping = LoRAMapping.build(np.repeat(per_req, num_scheduled), self.device)
        try:
            yield
        finally:
            self.ctx.mapping = None

    def _slot_for(self, key: tuple[int, str], lr: LoRARequest, needed: dict) -> int:
        if key in self.slot_ids:
            slot = self.slot_ids.index(key)
        else:
            free = [s for s, k in enumerate(self.slot_ids) if k is None or k not in needed]
            slot = min(free, key=lambda s: (self.slot_ids[s] is not None, self.slot_last_use[s]))
            write_adapter(self.stacks, slot, self._adapter(key, lr))
            self.slot_ids[slot] = key
        self.slot_last_use[slot] = self.steps
        return slot

    def _adapter(self, key: tuple[int, str], lr: LoRARequest) -> LoRAAdapter:
        adapter = self.host.pop(key, None)
        if adapter is None:
            adapter = load_adapter(lr.lora_name, lr.lora_path, self.arch, self.config)
            self.loads += 1
            while len(self.host) >= self.config.cpu_capacity:
                self.host.popitem(last=False)
        self.host[key] = adapter
        return adapter

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter (unloaded at run time): its slot and its host copy."""
        for key in [k for k in self.host if k[0] == lora_int_id]:
            del self.host[key]
        for s, key in enumerate(self.slot_ids):
            if key is not None and key[0] == lora_int_id:
                self.slot_ids[s] = None
