"""LoRARequest: which adapter a request runs with (vLLM's offline name and fields)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ParameterError


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name` is what users call the adapter (the HTTP `model` field), `lora_int_id` its
    number inside an engine (> 0; the slots and caches are keyed by it), `lora_path` a PEFT
    adapter directory (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ParameterError("lora_name", f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ParameterError("lora_int_id", f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ParameterError("lora_path", f"lora_path must be a PEFT adapter directory, got {self.lora_path!r}")
