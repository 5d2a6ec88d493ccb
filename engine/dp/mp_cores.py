"""Data-parallel engine cores as processes on this node ("mp" backend).

Each core is a spawned process holding one EngineCore (whose own executor may spawn its
tensor-parallel ranks, so the core processes are not daemons) and runs DPCoreLoop. A pipe
carries messages both ways; one reader thread per core in the front end moves that core's
messages to the shared outbox, and when the pipe closes without a Shutdown (the process died)
it posts a CoreFailed instead, so a death is seen at once, not after a collective timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import threading
import traceback
import weakref
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch

from engine.child_signals import apply_blocked_signals, process_blocked_signals
from engine.config import EngineConfig
from engine.core import EngineCore, resolve_device
from engine.distributed import COLLECTIVE_TIMEOUT, DPPlacement
from engine.dp.control import DPControlGroup
from engine.dp.core_loop import WAKE, DPCoreLoop
from engine.dp.cores import DPCores, core_label, register_dp_backend
from engine.dp.messages import CoreFailed, CoreReady, Shutdown
from engine.errors import EngineDeadError, ParameterError
from engine.executor.multiproc import reap_children
from engine.kv_connector import KVConnectorFactory

_STOP_GRACE_S = 10.0


class MPCores(DPCores):
    def __init__(self, config: EngineConfig, kv_connector_factory: KVConnectorFactory | None,
                 outbox: queue.Queue) -> None:
        super().__init__(config, kv_connector_factory, outbox)
        if kv_connector_factory is not None and self.size > 1:
            raise ParameterError("data_parallel_backend", "a KV connector (P/D transfer) with data_parallel_size > 1 "
                                 "needs data_parallel_backend='ray'")
        if kv_connector_factory is not None and not getattr(kv_connector_factory, "spawn_safe", False):
            # Only a relayed connector (its calls made by the front end's process) can cross.
            raise ParameterError("engine_core_process", "engine_core_process: this KV connector cannot run in "
                                 "a spawned engine core process (it is not spawn_safe)")
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        lockstep = config.parallel.lockstep
        # Rendezvous files of a lockstep group's process groups; independent cores need none.
        self.dir = tempfile.mkdtemp(prefix="pdserve-dp-") if lockstep else None
        self._finalizer = weakref.finalize(self, _reap, self.procs, self.conns, self.dir, self._stopping)
        world = f"file://{self.dir}/world" if lockstep else None
        control = f"file://{self.dir}/control" if lockstep else None
        # The cores share this node's cores; each core's tensor-parallel ranks share its share.
        threads = max(1, torch.get_num_threads() // self.size)
        devices = _gpu_slices(config, self.size)
        ctx = mp.get_context("spawn")  # fork would copy the front end's threads
        blocked = process_blocked_signals()  # the replica's, for each core (engine.child_signals)
        for rank in range(self.size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=run_core, name=f"pdserve-dp{rank}", daemon=False,
                               args=(config, DPPlacement(rank, self.size, world), control, child, threads,
                                     devices[rank] if devices else None, blocked, kv_connector_factory))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
            threading.Thread(target=self._read, args=(rank,), name=f"pdserve-dp{rank}-reader", daemon=True).start()

    def _label(self, rank: int) -> str:
        return core_label(self.config.parallel, rank)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _read(self, rank: int) -> None:
        conn, proc = self.conns[rank], self.procs[rank]
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            self.outbox.put(message)
        if not self._stopping.is_set():
            proc.join(1.0)  # for its exit code
            self.outbox.put(CoreFailed(rank, f"{self._label(rank)} (pid {proc.pid}) exited with code "
                                             f"{proc.exitcode}"))

    def send(self, rank: int, message: object) -> None:
        try:
            with self._lock:
                self.conns[rank].send(message)
        except OSError as e:
            raise EngineDeadError(f"{self._label(rank)} (pid {self.procs[rank].pid}) is gone: {e}") from None

    def check_health(self) -> None:
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                raise EngineDeadError(f"{self._label(rank)} (pid {proc.pid}) exited with code {proc.exitcode}")

    def shutdown(self) -> None:
        self._finalizer()


def _gpu_slices(config: EngineConfig, size: int) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES of each core (tensor_parallel_size GPUs each), or None on CPU."""
    if resolve_device(config.model.device).type != "cuda":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    tp = config.parallel.tensor_parallel_size
    if len(ids) < size * tp:
        raise ParameterError("data_parallel_size", f"data_parallel_size={size} x tensor_parallel_size={tp} needs "
                             f"{size * tp} GPUs; {len(ids)} visible")
    return [",".join(ids[r * tp:(r + 1) * tp]) for r in range(size)]


def _reap(procs: list[BaseProcess], conns: list[Connection], store_dir: str | None,
          stopping: threading.Event) -> None:
    """Ask every core to stop, then reap_children; no process outlives the front end."""
    stopping.set()
    reap_children(procs, conns, lambda conn: conn.send(Shutdown()), store_dir, _STOP_GRACE_S)


def run_core(config: EngineConfig, dp: DPPlacement, control_init: str | None, conn: Connection,
             num_threads: int, cuda_devices: str | None, blocked_signals: set[int] | None = None,
             kv_connector_factory: KVConnectorFactory | None = None) -> None:
    """Process entry point of one core."""
    apply_blocked_signals(blocked_signals)
    if cuda_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_devices  # before CUDA is first touched
    torch.set_num_threads(num_threads)
    try:
        core = EngineCore(config, kv_connector_factory, dp=dp)
        control = DPControlGroup(dp.rank, dp.size, control_init, COLLECTIVE_TIMEOUT) if control_init else None
    except BaseException:
        conn.send(CoreFailed(dp.rank, traceback.format_exc()))
        return
    try:
        serve_core(core, dp.rank, control, conn)
    finally:
        core.shutdown()


def serve_core(core: EngineCore, rank: int, control: DPControlGroup | None, conn: Connection) -> None:
    """Announce the core, then run its loop until Shutdown or until the front end is gone."""
    inbox: queue.Queue = queue.Queue()
    core.set_kv_wakeup(lambda: inbox.put(WAKE))

    def read() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = Shutdown()  # the front end is gone: nobody is left to answer
            inbox.put(message)
            if isinstance(message, Shutdown):
                return

    conn.send(CoreReady(rank, core.max_model_len, core.num_kv_blocks, core.arch.vocab_size))
    threading.Thread(target=read, name="pdserve-dp-input", daemon=True).start()
    DPCoreLoop(core, rank, control, conn.send).run(inbox)


register_dp_backend("mp", MPCores)
