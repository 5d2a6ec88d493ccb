"""Where the data-parallel engine cores of one front end run: the interface every backend
fills, and the registry of backends ("mp" here; "ray" registers itself from `actors`, as the
Ray executor does, since the engine never imports Ray)."""

from __future__ import annotations

import queue
from abc import ABC, abstractmethod

from engine.config import EngineConfig
from engine.errors import ParameterError
from engine.kv_connector import KVConnectorFactory

# Loading a model and warming it up on every core; the cores start together (under expert
# parallelism their warm-up forward passes are collective).
START_TIMEOUT_S = 600.0


class DPCores(ABC):
    """`config.parallel.data_parallel_size` engine cores. Every message a core sends (and a
    CoreFailed for a core that dies or stops answering) is put on `outbox`, in the order that
    core sent them."""

    def __init__(self, config: EngineConfig, kv_connector_factory: KVConnectorFactory | None,
                 outbox: queue.Queue) -> None:
        self.config = config
        self.size = config.parallel.data_parallel_size
        self.outbox = outbox

    @abstractmethod
    def send(self, rank: int, message: object) -> None:
        """Queue `message` for core `rank` (in order with earlier ones)."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise EngineDeadError if a core is known to be gone (any thread)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every core and release what it holds; bounded and idempotent."""


_BACKENDS: dict[str, type[DPCores]] = {}


def register_dp_backend(name: str, cls: type[DPCores]) -> None:
    _BACKENDS[name] = cls


def core_label(parallel, rank: int | None = None) -> str:
    """How errors name a core (or, without a rank, the cores): a lone core run apart from its
    front end (engine_core_process) is not a data-parallel one to the user who asked for it."""
    if parallel.engine_core_process:
        return "the engine core process"
    return "data-parallel cores" if rank is None else f"data-parallel core {rank}"


def dp_backend(name: str) -> type[DPCores]:
    if name not in _BACKENDS:
        raise ParameterError(
            "data_parallel_backend",
            f"data_parallel_backend={name!r} is not available in this process (available: {sorted(_BACKENDS)}); "
            "the 'ray' backend is registered by importing actors.dp_cores",
        )
    return _BACKENDS[name]
