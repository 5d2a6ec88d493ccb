"""Multi-LoRA: many PEFT adapters over one base model, per request (docs/lora.md)."""

from engine.lora.config import LoRAConfig
from engine.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
