"""One worker in the engine's own process: what every engine was before the executor seam."""

from __future__ import annotations

from typing import Any

from engine.executor.base import Executor, WorkerConfig
from engine.kv_connector import KVConnectorFactory
from engine.sched_output import ModelRunnerOutput, SchedulerOutput
from engine.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: WorkerConfig, kv_connector_factory: KVConnectorFactory | None = None) -> None:
        super().__init__(config)
        self.worker: Worker | None = Worker(config, rank=0, kv_connector_factory=kv_connector_factory)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._worker().execute_model(scheduler_output)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        return [getattr(self._worker(), method)(*args, **(kwargs or {}))]

    def shutdown(self) -> None:
        self.worker = None

    def _worker(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("the executor was shut down")
        return self.worker
