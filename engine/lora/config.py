"""LoRAConfig: the engine's adapter limits, under vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ParameterError

# Ranks above this are full fine-tunes in disguise; the slots hold max_lora_rank per slice.
MAX_RANK = 512


@dataclass(frozen=True)
class LoRAConfig:
    """`max_loras` adapters run in one step (device slots); `max_cpu_loras` stay loaded
    behind them in host memory (LRU); every adapter's rank is at most `max_lora_rank`."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # default: max_loras

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParameterError(name, f"{name} must be an integer >= 1, got {value!r}")
        if self.max_lora_rank > MAX_RANK:
            raise ParameterError("max_lora_rank", f"max_lora_rank must be in [1, {MAX_RANK}], got {self.max_lora_rank}")
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras):
            raise ParameterError("max_cpu_loras", f"max_cpu_loras must be an integer >= max_loras "
                                 f"({self.max_loras}), got {cpu!r}")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @classmethod
    def from_args(cls, enable_lora: bool, max_loras: int, max_lora_rank: int,
                  max_cpu_loras: int | None) -> LoRAConfig | None:
        return cls(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None
