"""What an EngineWorker needs of its engine: an EngineClient (engine/engine_client.py) with a
replica's figures and workers. engine.AsyncLLM answers it, and tests inject stand-ins that do
(`EngineWorker(engine_cls=...)`). The worker asks nothing else, so it never
looks inside the engine for its executor, its cores or their kinds."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from engine.engine_client import EngineClient
from engine.engine_request import EngineRequest
from engine.load import EngineLoad
from engine.outputs import RequestOutput


class ServingEngine(EngineClient, Protocol):
    def generate(self, request: EngineRequest, *, observe: Callable[[RequestOutput], None] | None = None,
                 stream_interval_s: float = 0.0) -> AsyncIterator[RequestOutput]: ...

    async def submit(self, request: EngineRequest, sink: Callable[[object], None]) -> None: ...

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
