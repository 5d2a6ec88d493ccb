"""A core's child process: spawned, read by a thread of its own, stopped with a grace
period (engine.core_client.client drives one; engine.dp.mp_cores several)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import weakref
from collections.abc import Callable

from engine.core_client.messages import CoreFailed, Shutdown
from engine.errors import EngineDeadError
from engine.executor.multiproc import reap_children

STOP_GRACE_S = 10.0  # a core asked to stop has this long before it is killed


class CoreProcess:
    """One spawned core process, `target(*args, child_conn)`; its messages go to `outbox`."""

    def __init__(self, target: Callable, args: tuple, outbox: queue.Queue, rank: int, label: str,
                 name: str) -> None:
        self.rank = rank
        self.label = label  # how errors name it
        self.outbox = outbox
        ctx = mp.get_context("spawn")  # fork would copy the front end's threads
        parent, child = ctx.Pipe()
        self.conn = parent
        self.proc = ctx.Process(target=target, name=name, daemon=False, args=(*args, child))
        self._lock = threading.Lock()
        self.stopping = threading.Event()
        self.proc.start()
        child.close()
        threading.Thread(target=self._read, name=f"{name}-reader", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            self.outbox.put(message)
        if not self.stopping.is_set():
            self.proc.join(1.0)  # for its exit code
            self.outbox.put(CoreFailed(self.rank, f"{self.label} (pid {self.pid}) exited with code "
                                                  f"{self.proc.exitcode}"))

    def send(self, message: object) -> None:
        try:
            with self._lock:
                self.conn.send(message)
        except OSError as e:
            raise EngineDeadError(f"{self.label} (pid {self.pid}) is gone: {e}") from None

    def check_health(self) -> None:
        if not self.proc.is_alive():
            raise EngineDeadError(f"{self.label} (pid {self.pid}) exited with code {self.proc.exitcode}")


def stop_core_processes(processes: list[CoreProcess], store_dir: str | None = None) -> None:
    """Ask every core to stop, then kill what is left after STOP_GRACE_S; none outlives its
    front end. Idempotent."""
    for p in processes:
        p.stopping.set()
        try:
            p.send(Shutdown())  # under its lock: the engine thread may be sending too
        except EngineDeadError:
            pass  # already gone
    reap_children([p.proc for p in processes], [p.conn for p in processes], lambda conn: None, store_dir,
                  STOP_GRACE_S)


def reap_at_exit(owner: object, processes: list[CoreProcess], store_dir: str | None = None) -> Callable[[], None]:
    """A finalizer that stops `processes` when `owner` is collected or the interpreter exits
    (call it to stop them now)."""
    return weakref.finalize(owner, stop_core_processes, processes, store_dir)
