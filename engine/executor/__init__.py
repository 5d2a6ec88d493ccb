"""The executor seam (docs/architecture.md#seams): the EngineCore talks to its workers only through an
`Executor`. `UniProcExecutor` runs one worker in the engine's own process;
`MultiprocExecutor` runs one process per tensor-parallel rank on this node; a Ray executor
(one actor per rank) registers itself from outside the engine, which never imports Ray."""

from engine.errors import ParameterError
from engine.executor.base import Executor, WorkerConfig
from engine.executor.multiproc import MultiprocExecutor
from engine.executor.uniproc import UniProcExecutor

_EXECUTORS: dict[str, type[Executor]] = {"uni": UniProcExecutor, "mp": MultiprocExecutor}


def register_executor(backend: str, cls: type[Executor]) -> None:
    """Make `distributed_executor_backend=backend` build `cls`."""
    _EXECUTORS[backend] = cls


def executor_class(backend: str) -> type[Executor]:
    if backend not in _EXECUTORS:
        raise ParameterError(
            "distributed_executor_backend",
            f"distributed_executor_backend={backend!r} is not available in this process (available: "
            f"{sorted(_EXECUTORS)}); the 'ray' executor is registered by importing actors.ray_executor",
        )
    return _EXECUTORS[backend]


__all__ = ["Executor", "MultiprocExecutor", "UniProcExecutor", "WorkerConfig", "executor_class",
           "register_executor"]
