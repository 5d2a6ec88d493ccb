"""The executor seam (seed 004): the EngineCore talks to its workers only through an
`Executor`. `UniProcExecutor` runs one worker in the engine's own process; multi-process and
Ray executors (tensor parallel) implement the same interface."""

from engine.executor.base import Executor, WorkerConfig
from engine.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor", "WorkerConfig"]
