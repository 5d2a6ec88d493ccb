"""DPEngineClient: what the LLMEngine drives instead of one EngineCore when
data_parallel_size > 1, or when one core runs in a child process (engine_core_process); and
so what LLM and AsyncLLM run on.

Requests go to the core the coordinator picks (least loaded; waves for lockstep groups);
aborts to the core that holds the request. Each core runs its own loop and sends one CoreStep
per step; `step()` returns every output that has arrived, waiting a little for the first one
so its driver does not spin. Every wait is bounded, and a core that dies fails the whole
group: its peers may sit in a collective with it, so they are stopped too, and every later
call raises EngineDeadError.
"""

from __future__ import annotations

import itertools
import queue
import time

from engine.config import EngineConfig
from engine.core import check_parallel, resolve_device
from engine.dp import mp_cores  # noqa: F401  (registers the "mp" backend)
from engine.dp.coordinator import DPCoordinator
from engine.dp.cores import START_TIMEOUT_S, core_label, dp_backend
from engine.dp.messages import (
    AbortRequests,
    AddRequest,
    CallResult,
    CoreCall,
    CoreFailed,
    CoreReady,
    CoreStep,
    StartWaveRequest,
    WaveComplete,
)
from engine.errors import EngineDeadError
from engine.kv_connector import KVConnectorFactory
from engine.models.arch import load_arch
from engine.request import Request, RequestStatus
from engine.sched.output import EngineCoreOutput

# The longest step() waits for a core's message before returning nothing (a wake() ends it
# sooner): the driver then looks at its own inputs again.
_STEP_WAIT_S = 0.1
_CALL_TIMEOUT_S = 60.0
_WAKE = object()
# Figures summed over the cores in load(); the rest are recomputed from sums or per core.
_RATIOS = ("kv_usage", "prefix_cache_hit_rate")


class DPEngineClient:
    def __init__(self, config: EngineConfig, kv_connector_factory: KVConnectorFactory | None = None) -> None:
        self.config = config
        parallel = config.parallel
        self.size = parallel.data_parallel_size
        self.arch = load_arch(config.model.model)
        # Here, before any core starts, so a bad size is the user's ParameterError.
        check_parallel(self.arch, resolve_device(config.model.device), parallel)
        self.coordinator = DPCoordinator(self.size, parallel.lockstep)
        # Each core's latest figures, kept by the threads that receive its messages (so they
        # are current even while nothing drives step()): load(fresh=False) reads them.
        self._figures: list[dict | None] = [None] * self.size
        self._inbox: queue.Queue = _Inbox(self._figures)
        self._owners: dict[str, tuple[int, Request]] = {}  # unfinished request -> (core, request)
        self._ready: list[EngineCoreOutput] = []
        self._results: dict[int, CallResult] = {}
        self._call_ids = itertools.count()
        self.failure: str | None = None
        self.idle = False  # step() itself waits for the cores: its driver never has to poll
        self.last_step_ran_model = False
        self.cores = dp_backend(parallel.dp_backend)(config, kv_connector_factory, self._inbox)
        try:
            ready = self._wait_ready()
            deadline = time.monotonic() + START_TIMEOUT_S
            while any(f is None for f in self._figures):  # every core's first figures
                if time.monotonic() > deadline:
                    raise EngineDeadError(f"{core_label(self.config.parallel)} sent no figures after starting")
                self._pump(_STEP_WAIT_S)
        except BaseException:
            self.cores.shutdown()
            raise
        self.max_model_len = ready.max_model_len
        self.num_kv_blocks = ready.num_kv_blocks

    def _wait_ready(self) -> CoreReady:
        ready: dict[int, CoreReady] = {}
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(ready) < self.size:
            try:
                message = self._inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(self.size)) - set(ready))
                raise EngineDeadError(f"{core_label(self.config.parallel)} {missing} did not start within {START_TIMEOUT_S:.0f} s") \
                    from None
            if isinstance(message, CoreFailed):
                raise EngineDeadError(f"{core_label(self.config.parallel, message.rank)} failed to start:\n"
                                      f"{message.message}")
            if isinstance(message, CoreReady):
                ready[message.rank] = message
        return ready[0]

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self._check()
        rank, wave, starts = self.coordinator.route()
        for target, start in starts:
            self.cores.send(target, start)
        self._owners[request.request_id] = (rank, request)
        self.cores.send(rank, AddRequest(request, wave, time.monotonic() - request.arrival_time))

    def abort_requests(self, request_ids: list[str], status=RequestStatus.FINISHED_ABORTED) -> None:
        by_core: dict[int, list[str]] = {}
        for rid in request_ids:
            owner = self._owners.pop(rid, None)
            if owner is not None:
                by_core.setdefault(owner[0], []).append(rid)
        if self.failure is not None:
            return  # the cores are gone, and their requests with them
        for rank, ids in by_core.items():
            self.cores.send(rank, AbortRequests(tuple(ids), status))

    def step(self) -> list[EngineCoreOutput]:
        self._check()
        if not self._ready:
            self._pump(_STEP_WAIT_S)
        outputs, self._ready = self._ready, []
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._owners)

    def has_work(self) -> bool:
        return bool(self._owners) or bool(self._ready)

    def get_num_unfinished_requests(self) -> int:
        return len(self._owners)

    def wake(self) -> None:
        """Cut a waiting step() short: its driver has new input (any thread)."""
        self._inbox.put(_WAKE)

    def set_kv_wakeup(self, callback) -> None:
        """Each core wakes its own loop when its KV arrives; nothing to forward."""

    # ---- messages from the cores --------------------------------------------------------
    def _pump(self, wait_s: float) -> None:
        """Handle the cores' messages: wait up to `wait_s` for the first, then take what is
        there."""
        try:
            message = self._inbox.get(timeout=wait_s)
            while True:
                if message is not _WAKE:
                    self._handle(message)
                message = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, message) -> None:
        if isinstance(message, CoreStep):
            self.coordinator.on_figures(message.rank, message.waiting, message.running)
            for rid, queued in message.queue_times.items():
                owner = self._owners.get(rid)
                if owner is not None:
                    owner[1].first_scheduled_time = owner[1].arrival_time + queued
            for out in message.outputs:
                if out.request_id not in self._owners:
                    continue  # aborted here while the core was stepping
                if out.finished:
                    del self._owners[out.request_id]
                self._ready.append(out)
        elif isinstance(message, WaveComplete):
            self.coordinator.on_wave_complete(message.wave)
        elif isinstance(message, StartWaveRequest):
            for target, start in self.coordinator.on_start_wave_request(message.rank, message.wave):
                self.cores.send(target, start)
        elif isinstance(message, CallResult):
            self._results[message.call_id] = message
        elif isinstance(message, CoreFailed):
            self._fail(f"{core_label(self.config.parallel, message.rank)} failed:\n{message.message}")

    # ---- calls on every core ------------------------------------------------------------
    def _call_all(self, method: str, *args) -> list:
        """method(*args) on every core between its steps; one value per core, in rank order."""
        self._check()
        ids = []
        for rank in range(self.size):
            call_id = next(self._call_ids)
            ids.append(call_id)
            self.cores.send(rank, CoreCall(call_id, method, args))
        deadline = time.monotonic() + _CALL_TIMEOUT_S
        while not all(i in self._results for i in ids):
            if time.monotonic() > deadline:
                self._fail(f"{core_label(self.config.parallel)} did not answer {method!r} within {_CALL_TIMEOUT_S:.0f} s")
            self._pump(min(_STEP_WAIT_S, max(0.0, deadline - time.monotonic())))
            self._check()
        results = [self._results.pop(i) for i in ids]
        for result in results:
            if result.error is not None:
                raise RuntimeError(f"{core_label(self.config.parallel, result.rank)} failed in {method!r}:\n"
                                   f"{result.error}")
        return [r.value for r in results]

    def load(self, fresh: bool = True) -> dict:
        """The group's figures: counts summed over the cores, ratios recomputed from the sums,
        and per-core figures under "data_parallel". `fresh`: asked from every core now (one
        step's wait on the engine thread); otherwise the copies the cores sent with their steps
        (any thread, no wait: what a serving replica reports several times a second)."""
        per_core = self._call_all("load") if fresh else list(self._figures)
        total: dict = {}
        for key, value in per_core[0].items():
            if key in _RATIOS or key.startswith("dp_"):
                continue
            if isinstance(value, list):
                total[key] = [sum(v) for v in zip(*(f[key] for f in per_core))]
            else:
                total[key] = sum(f[key] for f in per_core)
        blocks = total.get("total_blocks", 0)
        total["kv_usage"] = (blocks - total.get("free_blocks", 0)) / blocks if blocks else 0.0
        queries = total.get("prefix_cache_queries", 0)
        total["prefix_cache_hit_rate"] = total.get("prefix_cache_hits", 0) / queries if queries else 0.0
        if not self.config.parallel.engine_core_process:  # one core apart is not data parallelism
            total["data_parallel"] = [
                {"rank": r, "waiting": f["waiting"], "running": f["running"], "requests": f["dp_requests"],
                 "dummy_steps": f["dp_dummy_steps"], "wave": f["dp_wave"]} for r, f in enumerate(per_core)]
        return total

    def reset_prefix_cache(self) -> bool:
        return all(self._call_all("reset_prefix_cache"))

    def kv_transfer_stats(self) -> dict:
        return _summed(self._call_all("kv_transfer_stats"))

    def kv_outbox_size(self) -> int:
        return sum(self._call_all("kv_outbox_size"))

    # ---- health and shutdown ------------------------------------------------------------
    def _check(self) -> None:
        if self.failure is not None:
            raise EngineDeadError(self.failure)

    def _fail(self, message: str):
        self.failure = message
        self.cores.shutdown()
        raise EngineDeadError(message)

    def check_health(self) -> None:
        self._check()
        self.cores.check_health()

    def shutdown(self) -> None:
        self.cores.shutdown()


def _summed(figures: list[dict]) -> dict:
    """Counters of several cores (or ranks), added key by key."""
    total: dict = {}
    for f in figures:
        for key, value in f.items():
            total[key] = total.get(key, 0) + value
    return total


class _Inbox(queue.Queue):
    """The cores' messages, noting each core's figures as they arrive."""

    def __init__(self, figures: list[dict | None]) -> None:
        super().__init__()
        self._figures = figures

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        if isinstance(item, CoreStep) and item.figures is not None:
            self._figures[item.rank] = item.figures
        super().put(item, block, timeout)
