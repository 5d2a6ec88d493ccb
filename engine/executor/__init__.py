"""The executor seam (docs/architecture.md#seams): the EngineCore talks to its workers only through an
`Executor`. `UniProcExecutor` runs one worker in the engine's own process;
`MultiprocExecutor` runs one process per tensor-parallel rank on this node; a Ray executor
(one actor per rank) registers itself from outside the engine, which never imports Ray."""

from engine.executor.base import Executor, WorkerConfig
from engine.executor.multiproc import MultiprocExecutor
from engine.executor.uniproc import UniProcExecutor
from engine.plugins import Registry

EXECUTORS: Registry[type[Executor]] = Registry(
    "distributed_executor_backend", "the 'ray' executor is registered by importing actors.ray_executor",
    {"uni": UniProcExecutor, "mp": MultiprocExecutor})


def register_executor(backend: str, cls: type[Executor]) -> None:
    """Make `distributed_executor_backend=backend` build `cls`."""
    EXECUTORS.register(backend, cls)


def executor_class(backend: str) -> type[Executor]:
    return EXECUTORS.get(backend)


__all__ = ["EXECUTORS", "Executor", "MultiprocExecutor", "UniProcExecutor", "WorkerConfig", "executor_class",
           "register_executor"]
