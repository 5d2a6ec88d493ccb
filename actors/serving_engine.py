"""What an EngineWorker needs of its engine: engine.AsyncLLM answers it, and tests inject
stand-ins that do (`EngineWorker(engine_cls=...)`). The worker asks nothing else, so it never
looks inside the engine for its executor, its cores or their kinds."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from engine.kv_transfer_params import KVTransferParams
from engine.load import EngineLoad
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class ServingEngine(Protocol):
    def generate(self, prompt, sampling_params: SamplingParams, request_id: str | None = None, *,
                 kv_transfer_params: KVTransferParams | None = None,
                 observe: Callable[[RequestOutput], None] | None = None,
                 stream_interval_s: float = 0.0) -> AsyncIterator[RequestOutput]: ...

    async def submit(self, prompt, sampling_params: SamplingParams, request_id: str,
                     sink: Callable[[object], None], *,
                     kv_transfer_params: KVTransferParams | None = None) -> None: ...

    async def abort(self, request_id: str) -> None: ...

    async def load(self) -> EngineLoad: ...

    async def kv_transfer_stats(self) -> dict: ...

    async def kv_outbox_size(self) -> int: ...

    def core_pids(self) -> list[int]: ...

    def core_actors(self) -> list: ...

    def rank_actors(self) -> list: ...

    def check_health(self) -> None:
        """Raise if the engine cannot serve any more (any thread)."""

    def shutdown(self) -> None: ...
