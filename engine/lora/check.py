"""The front end's check of a request's adapter, so a bad adapter is a ParameterError (an
HTTP 400/404) before any engine sees the request, never a failed step."""

from __future__ import annotations

import os

from engine.errors import ParameterError
from engine.lora.config import LoRAConfig
from engine.lora.peft import load_adapter
from engine.lora.request import LoRARequest
from engine.models.arch import ModelArch


class LoRAChecker:
    """Reads each adapter once per change of its files (the weights are checked, then
    dropped: the engine loads its own copy)."""

    def __init__(self, config: LoRAConfig | None, arch: ModelArch) -> None:
        self.config, self.arch = config, arch
        self._checked: dict[tuple[str, str], tuple] = {}

    def __call__(self, lora_request: LoRARequest | None) -> None:
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ParameterError("lora_request", "lora_request must be engine.lora.LoRARequest, "
                                 f"got {type(lora_request).__name__}")
        if self.config is None:
            raise ParameterError("lora_request", f"a request names the LoRA adapter {lora_request.lora_name!r} "
                                 "but this engine was started without enable_lora")
        key = (lora_request.lora_name, lora_request.lora_path)
        stamp = _stamp(lora_request.lora_path)
        if self._checked.get(key) != stamp:
            load_adapter(lora_request.lora_name, lora_request.lora_path, self.arch, self.config)
            self._checked[key] = stamp


def _stamp(path: str) -> tuple:
    try:
        return tuple(sorted((e.name, e.stat().st_mtime_ns, e.stat().st_size) for e in os.scandir(path)))
    except OSError:
        raise ParameterError("lora_path", f"lora_path {path!r} is not a readable directory") from None
