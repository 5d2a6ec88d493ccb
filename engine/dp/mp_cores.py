"""Data-parallel engine cores as processes on this node ("mp" backend).

Each core is a spawned process (engine.core_client.process.CoreProcess) holding one EngineCore
and running DPCoreLoop; its messages reach the front end's inbox through the process's reader
thread, and a core that dies is a CoreFailed at once, not after a collective timeout.
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback
from multiprocessing.connection import Connection

import torch

from engine.child_signals import process_blocked_signals
from engine.config import EngineConfig
from engine.core import EngineCore, resolve_device
from engine.core_client.core_proc import prepare_process, serve_core
from engine.core_client.messages import CoreFailed
from engine.core_client.process import CoreProcess, reap_at_exit
from engine.distributed import COLLECTIVE_TIMEOUT, DPPlacement
from engine.dp.control import DPControlGroup
from engine.dp.core_loop import DPCoreLoop
from engine.dp.cores import DPCores, register_dp_backend
from engine.errors import ParameterError
from engine.kv_connector import KVConnectorFactory


class MPCores(DPCores):
    def __init__(self, config: EngineConfig, kv_connector_factory: KVConnectorFactory | None,
                 outbox: queue.Queue) -> None:
        super().__init__(config, kv_connector_factory, outbox)
        if kv_connector_factory is not None:
            raise ParameterError("data_parallel_backend", "a KV connector (P/D transfer) with data_parallel_size > 1 "
                                 "needs data_parallel_backend='ray'")
        lockstep = config.parallel.lockstep
        # Rendezvous files of a lockstep group's process groups; independent cores need none.
        self.dir = tempfile.mkdtemp(prefix="pdserve-dp-") if lockstep else None
        self.processes: list[CoreProcess] = []
        self._stop = reap_at_exit(self, self.processes, self.dir)
        world = f"file://{self.dir}/world" if lockstep else None
        control = f"file://{self.dir}/control" if lockstep else None
        # The cores share this node's cores; each core's tensor-parallel ranks share its share.
        threads = max(1, torch.get_num_threads() // self.size)
        devices = _gpu_slices(config, self.size)
        blocked = process_blocked_signals()  # the replica's, for each core (engine.child_signals)
        for rank in range(self.size):
            args = (config, DPPlacement(rank, self.size, world), control, threads,
                    devices[rank] if devices else None, blocked)
            self.processes.append(CoreProcess(run_dp_core, args, outbox, rank, f"data-parallel core {rank}",
                                              f"pdserve-dp{rank}"))

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def send(self, rank: int, message: object) -> None:
        self.processes[rank].send(message)

    def check_health(self) -> None:
        for process in self.processes:
            process.check_health()

    def exited(self) -> str | None:
        gone = next((p for p in self.processes if not p.proc.is_alive()), None)
        return None if gone is None else f"{gone.label} (pid {gone.pid}) exited with code {gone.proc.exitcode}"

    def shutdown(self) -> None:
        self._stop()


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


def run_dp_core(config: EngineConfig, dp: DPPlacement, control_init: str | None, num_threads: int,
                cuda_devices: str | None, blocked_signals: set[int] | None, conn: Connection) -> None:
    """Process entry point of one data-parallel core."""
    prepare_process(blocked_signals, cuda_devices, num_threads)
    try:
        core = EngineCore(config, None, dp=dp, tokenizer_from_front_end=True)  # given by LLMEngine
        control = DPControlGroup(dp.rank, dp.size, control_init, COLLECTIVE_TIMEOUT) if control_init else None
    except BaseException:
        conn.send(CoreFailed(dp.rank, traceback.format_exc()))
        return
    try:
        serve_core(core, dp.rank, DPCoreLoop(core, dp.rank, control, conn.send), conn)
    finally:
        core.shutdown()


register_dp_backend("mp", MPCores)
