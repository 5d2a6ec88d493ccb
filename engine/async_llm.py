"""Asyncio streaming front over one LLMEngine: `async for out in engine.generate(...)`.

Every engine call (add, abort, step) runs on one dedicated thread, so the engine is never
touched concurrently and the event loop never blocks on a forward pass. A step loop runs
while any request is unfinished and parks when the engine is idle.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.processor import PromptType
from engine.sampling_params import SamplingParams


class AsyncLLM:
    def __init__(self, config: EngineConfig, connector=None, engine: LLMEngine | None = None) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-engine")
        self.engine = engine or LLMEngine(config, connector)
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop_task: asyncio.Task | None = None
        self._errored: BaseException | None = None

    async def _call(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; the last one has `finished=True`. Leaving the loop
        early (client gone, task cancelled) aborts the request and frees its KV blocks."""
        if self._errored is not None:
            raise RuntimeError("engine is dead") from self._errored
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            await self._call(
                self.engine.add_request, request_id, prompt, sampling_params, priority,
                cache_salt, kv_transfer_params,
            )
            self._ensure_loop()
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await asyncio.shield(self.abort(request_id))

    async def abort(self, request_id: str) -> None:
        await self._call(self.engine.abort_request, request_id)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())

    async def _step_loop(self) -> None:
        try:
            while self.engine.has_unfinished_requests():
                outputs = await self._call(self.engine.step)
                for out in outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
        except Exception as e:  # the engine is unusable: fail every stream, loudly
            self._errored = e
            for queue in self._queues.values():
                queue.put_nowait(e)
            raise

    async def load(self) -> dict:
        return await self._call(self.engine.core.load)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
