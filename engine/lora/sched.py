"""The scheduler's adapter limit: a step holds requests of at most `max_loras` adapters (the
device slots), so a waiting request of another adapter waits for a running one's to finish."""

from __future__ import annotations

from engine.load import LoRAFigures


def lora_slots_full(request, running: list, max_loras: int) -> bool:
    """Whether admitting `request` would bring a `max_loras + 1`-th adapter into the running set."""
    lr = request.lora_request
    if lr is None or not max_loras:
        return False
    active = {(r.lora_request.lora_int_id, r.lora_request.lora_path) for r in running if r.lora_request is not None}
    return (lr.lora_int_id, lr.lora_path) not in active and len(active) >= max_loras


class LoRAUsage:
    """Which adapters an engine runs, waits on and holds: vLLM's `vllm:lora_requests_info`,
    and what a router reads to send an adapter's requests where it is already loaded. Held
    adapters are the last `capacity` that steps ran (the worker's host cache keeps the same
    ones, engine.lora.runner), most recent last."""

    def __init__(self, max_loras: int, capacity: int) -> None:
        self.max_loras = max_loras
        self.capacity = capacity
        self._held: dict[str, None] = {}

    def scheduled(self, new_requests) -> None:
        for r in new_requests:
            if r.lora_request is not None:
                name = r.lora_request.lora_name
                self._held.pop(name, None)
                self._held[name] = None
                if len(self._held) > self.capacity:
                    del self._held[next(iter(self._held))]

    def figures(self, running, waiting) -> LoRAFigures:
        def names(requests) -> tuple[str, ...]:
            return tuple(sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None}))

        return LoRAFigures(names(running), names(waiting), tuple(self._held), self.max_loras)
