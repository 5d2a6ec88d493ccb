"""Tensor parallel on one node: one spawned process per rank, the EngineCore as their driver.

The EngineCore process holds no rank. It pickles each call once, writes it to every rank's
pipe and waits for the replies, watching every rank's process sentinel at the same time: a
rank that dies (or fails a call) is seen at once, not after a collective timeout, and the
executor turns it into an EngineDeadError. Keeping the driver outside the ranks costs one
pipe hop for rank 0's sampled tokens (a few bytes a step) and buys that the process that must
notice a failure is never itself blocked inside a collective with the dead peer.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from engine.distributed import COLLECTIVE_TIMEOUT
from engine.errors import EngineDeadError, ParameterError
from engine.executor.base import RankGroupExecutor, WorkerConfig
from engine.executor.kv_aggregate import KVOutputAggregator
from engine.executor.mp_worker import SHUTDOWN, run_worker
from engine.kv_connector import KVConnectorFactory

# Every wait is bounded. Starting covers spawning, importing torch and loading a shard; a call
# covers the longest step (a full-budget prefill on CPU); collectives inside the ranks time out
# on their own after _COLLECTIVE_TIMEOUT_S (the driver sees the failed call).
_START_TIMEOUT_S = 600.0
_CALL_TIMEOUT_S = 600.0
_COLLECTIVE_TIMEOUT_S = COLLECTIVE_TIMEOUT.total_seconds()
_STOP_GRACE_S = 5.0


class MultiprocExecutor(RankGroupExecutor):
    def __init__(self, config: WorkerConfig, kv_connector_factory: KVConnectorFactory | None = None) -> None:
        super().__init__(config)
        if kv_connector_factory is not None:
            raise ParameterError(
                "tensor_parallel_size",
                "a KV connector (P/D transfer) needs tensor_parallel_size=1 with the 'mp' executor",
            )
        size = config.engine.parallel.tensor_parallel_size
        self.size = size
        self.kv_outputs = KVOutputAggregator(size)
        self.failure: str | None = None
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        store_dir = tempfile.mkdtemp(prefix="pdserve-tp-")
        # Reap the ranks even if the owner never calls shutdown (garbage collection, exit).
        self._finalizer = weakref.finalize(self, _reap, self.procs, self.conns, store_dir)
        ctx = mp.get_context("spawn")  # fork would copy a CUDA context and the engine's threads
        threads = max(1, torch.get_num_threads() // size)
        init_method = "file://" + os.path.join(store_dir, "store")
        for rank in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=run_worker, name=f"pdserve-tp{rank}", daemon=True,
                args=(config, rank, size, init_method, child, _COLLECTIVE_TIMEOUT_S, threads),
            )
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        try:
            self._replies(_START_TIMEOUT_S, "start")
        except EngineDeadError:
            self.shutdown()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        payload = pickle.dumps((method, args, kwargs or {}), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(payload)
            except OSError as e:
                self._fail(f"tensor-parallel rank {rank} (pid {self.procs[rank].pid}) is gone: {e}")
        return self._replies(_CALL_TIMEOUT_S, method)

    def set_kv_wakeup(self, callback) -> None:
        """Not forwarded: the callback lives in this process, and this executor takes no KV
        connector."""

    def check_health(self) -> None:
        """Between steps (any thread): a rank that died while the engine was idle fails the
        health check now rather than the next request."""
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        dead = [(rank, p) for rank, p in enumerate(self.procs) if not p.is_alive()]
        if dead:
            rank, proc = dead[0]
            raise EngineDeadError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")

    def _replies(self, timeout_s: float, what: str) -> list[Any]:
        """One reply per rank, in rank order; any death, error or timeout fails the engine."""
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        by_conn = {conn: rank for rank, conn in enumerate(self.conns)}
        by_sentinel = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        while len(results) < self.size:
            pending = [c for c, r in by_conn.items() if r not in results]
            ready = wait(pending + list(by_sentinel), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._fail(f"tensor-parallel ranks {sorted(set(range(self.size)) - set(results))} "
                           f"did not answer {what!r} within {timeout_s:.0f} s")
            for obj in ready:
                if obj in by_conn:
                    rank = by_conn[obj]
                    try:
                        status, value = obj.recv()
                    except (EOFError, OSError):
                        continue  # its sentinel reports the exit
                    if status == "error":
                        self._fail(f"tensor-parallel rank {rank} failed in {what!r}:\n{value}")
                    results[rank] = value
            for obj in ready:
                if obj in by_sentinel:
                    proc = self.procs[by_sentinel[obj]]
                    self._fail(f"tensor-parallel rank {by_sentinel[obj]} (pid {proc.pid}) exited with "
                               f"code {proc.exitcode} during {what!r}")
        return [results[r] for r in range(self.size)]

    def _fail(self, message: str):
        """Remember why, stop every rank (the survivors may sit in a collective with the dead
        one), raise."""
        self.failure = message
        self.shutdown()
        raise EngineDeadError(message)

    def shutdown(self) -> None:
        self._finalizer()


def _reap(procs: list[BaseProcess], conns: list[Connection], store_dir: str) -> None:
    """Ask every rank to stop, then terminate and finally kill what is left; join all, so no
    process outlives the executor (not even as a zombie)."""
    stop = pickle.dumps((SHUTDOWN, (), {}))
    reap_children(procs, conns, lambda conn: conn.send_bytes(stop), store_dir, _STOP_GRACE_S)


def reap_children(procs: list[BaseProcess], conns: list[Connection], send_stop, store_dir: str | None,
                  grace_s: float) -> None:
    """Send each child its stop message (a closed pipe is a child already gone), stop_processes,
    close the pipes and remove the rendezvous directory (if any)."""
    for conn in conns:
        try:
            send_stop(conn)
        except OSError:
            pass
    stop_processes(procs, grace_s)
    for conn in conns:
        conn.close()
    if store_dir is not None:
        shutil.rmtree(store_dir, ignore_errors=True)


def stop_processes(procs: list[BaseProcess], grace_s: float) -> None:
    """Give processes that were asked to stop `grace_s` to exit, then kill what is left (a rank
    may sit in a collective with a dead peer); join all, so none outlives its owner, not even as
    a zombie. No SIGTERM step: a served engine core blocks it (engine.child_signals), and our
    children install no handler for it, so it would only add a wait."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for proc in alive:
        proc.kill()
    for proc in alive:
        proc.join(grace_s)
