"""The life of one tensor-parallel rank in its own process ("mp" executor): join the process
group, build the Worker, then answer the driver's calls until told to stop or until the
driver is gone."""

from __future__ import annotations

import dataclasses
import pickle
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

import torch

from engine.distributed import destroy_tp_group, init_parallel_groups
from engine.executor.base import WorkerConfig, rank_reply
from engine.worker.worker import Worker

SHUTDOWN = "__shutdown__"


def run_worker(config: WorkerConfig, rank: int, size: int, init_method: str, conn: Connection,
               collective_timeout_s: float, num_threads: int) -> None:
    """Process entry point. Replies are ("ok", result) or ("error", traceback text)."""
    try:
        # Ranks share the node's cores; without this each would start one thread per core.
        torch.set_num_threads(num_threads)
        if config.device.type == "cuda":
            torch.cuda.set_device(rank)
            config = dataclasses.replace(config, device=torch.device("cuda", rank))
        tp, ep = init_parallel_groups(rank, size, config.dp, config.engine.parallel.enable_expert_parallel,
                                      init_method, config.device, timedelta(seconds=collective_timeout_s))
        worker = Worker(config, rank, tp=tp, ep=ep)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    try:
        _serve(worker, conn)
    finally:
        destroy_tp_group()


def _serve(worker: Worker, conn: Connection) -> None:
    while True:
        try:
            method, args, kwargs = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the driver is gone: no one is left to answer
        if method == SHUTDOWN:
            return
        try:
            reply = ("ok", rank_reply(worker.tp.is_driver, method, getattr(worker, method)(*args, **kwargs)))
        except Exception:
            reply = ("error", traceback.format_exc())
        conn.send(reply)
