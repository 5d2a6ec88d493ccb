"""Where the data-parallel engine cores of one front end run: the interface every backend
fills, and the registry of backends ("mp" here; "ray" registers itself from `actors`, as the
Ray executor does, since the engine never imports Ray)."""

from __future__ import annotations

import queue
from abc import ABC, abstractmethod

from engine.config import EngineConfig
from engine.kv_connector import KVConnectorFactory
from engine.plugins import Registry


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

    def pids(self) -> list[int]:
        """The cores' process ids when they are processes on this node."""
        return []

    def exited(self) -> str | None:
        """How a core process on this node exited, if one has (read locally); None otherwise,
        and always for cores that are not processes here."""
        return None

    def actor_handles(self) -> list:
        """The cores' Ray actor handles when they are actors."""
        return []


BACKENDS: Registry[type[DPCores]] = Registry(
    "data_parallel_backend", "the 'ray' backend is registered by importing actors.dp_cores")


def register_dp_backend(name: str, cls: type[DPCores]) -> None:
    """Make `data_parallel_backend=name` build `cls`."""
    BACKENDS.register(name, cls)


def dp_backend(name: str) -> type[DPCores]:
    return BACKENDS.get(name)
