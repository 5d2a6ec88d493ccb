"""One worker in the engine's own process: what every engine was before the executor seam."""

from __future__ import annotations

from typing import Any

from engine.distributed import COLLECTIVE_TIMEOUT, destroy_tp_group, init_parallel_groups
from engine.executor.base import Executor, WorkerConfig
from engine.kv_connector import KVConnectorFactory
from engine.sched.output import ModelRunnerOutput, SchedulerOutput
from engine.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: WorkerConfig, kv_connector_factory: KVConnectorFactory | None = None) -> None:
        super().__init__(config)
        # One rank, but under expert parallelism it shares the experts with the other
        # data-parallel cores' ranks: it joins their world here.
        tp, ep = init_parallel_groups(0, 1, config.dp, config.engine.parallel.enable_expert_parallel, None,
                                      config.device, COLLECTIVE_TIMEOUT)
        self._joined_world = ep.size > 1
        self.worker: Worker | None = Worker(config, rank=0, kv_connector_factory=kv_connector_factory, tp=tp, ep=ep)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._worker().execute_model(scheduler_output)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        return [getattr(self._worker(), method)(*args, **(kwargs or {}))]

    def shutdown(self) -> None:
        self.worker = None
        if self._joined_world:
            self._joined_world = False
            destroy_tp_group()

    def _worker(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("the executor was shut down")
        return self.worker
