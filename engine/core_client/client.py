"""The front end's side of engine cores that run apart from it, reached by messages.

`CoresClient` is what both kinds of client share: requests go to a core and are remembered
until their last output, each core sends one CoreStep per step, `step()` returns every output
that has arrived (waiting a little for the first, so its driver does not spin), calls run on every core
between its steps, and every wait is bounded. A core that dies fails the client: every later
call raises EngineDeadError. `CoreProcClient` is one core in a child process
(engine_core_process); engine.dp.DPEngineClient is several data-parallel cores.

`CoreProcess` (engine.core_client.process) spawns one core process (not a daemon: its executor may spawn tensor-parallel
ranks of its own), sends it messages, and runs one reader thread that moves the core's
messages to the client's inbox; when the pipe closes without a Shutdown (the process died) the
reader posts a CoreFailed instead, so a death is seen at once. The core's side of the pipe is
engine.core_client.core_proc. CoreProcClient and each data-parallel core of the "mp" backend
(engine.dp.mp_cores) use it.
"""

from __future__ import annotations

import itertools
import queue
import time
from abc import ABC, abstractmethod

import torch

from engine.child_signals import process_blocked_signals
from engine.config import EngineConfig
from engine.core import check_parallel, resolve_device
from engine.core_client.core_proc import run_core
from engine.core_client.messages import (
    AbortRequests,
    AddRequest,
    CallResult,
    CoreCall,
    CoreFailed,
    CoreReady,
    CoreStep,
)
from engine.core_client.process import CoreProcess, reap_at_exit
from engine.core_client.watchdog import CoreInbox, Silence
from engine.errors import EngineDeadError, ParameterError
from engine.kv_cache.events import MEDIA, KVSnapshot
from engine.kv_cache.prefix_index import PrefixIndex
from engine.kv_connector import KVConnectorFactory, spawn_safe
from engine.load import EngineLoad, summed_counters
from engine.models.arch import load_arch
from engine.request import Request, RequestStatus
from engine.sched.output import EngineCoreOutput

# Loading a model and warming it up on every core (under expert parallelism their warm-up
# forward passes are collective, so the cores start together).
START_TIMEOUT_S = 600.0
# The longest step() waits for a core's message before returning nothing (a wake() ends it
# sooner): the driver then looks at its own inputs again.
STEP_WAIT_S = 0.1
_CALL_TIMEOUT_S = 60.0
_WAKE = object()


class CoresClient(ABC):
    runs_apart = True  # load(fresh=False) serves the figures the cores sent: any thread, no wait
    idle = False  # step() itself waits for the cores: its driver never has to poll
    last_step_ran_model = False

    def __init__(self, config: EngineConfig, size: int) -> None:
        self.config = config
        self.size = size
        self.arch = load_arch(config.model.model)
        # Each core's latest figures, kept by the threads that receive its messages (so they
        # are current even while nothing drives step()): load(fresh=False) reads them.
        self._figures: list[EngineLoad | None] = [None] * size
        self.silence = Silence(size, config.engine_step_timeout_s)  # the hang watchdog's clock
        self._inbox: queue.Queue = CoreInbox(self._figures, self.silence)
        self._owners: dict[str, tuple[int, Request]] = {}  # unfinished request -> (core, request)
        self._ready: list[EngineCoreOutput] = []
        self._results: dict[int, CallResult] = {}
        self._call_ids = itertools.count()
        self.failure: str | None = None
        self.max_model_len = 0
        self.num_kv_blocks = 0
        # Which prefix blocks each core holds, from the KV events its steps carry (when they are
        # on): data-parallel routing reads it; a core whose events had a gap is re-read whole.
        self.kv_index = PrefixIndex()
        self._kv_stale: set[int] = set()
        self._kv_union: tuple[tuple[int, ...], KVSnapshot] | None = None  # kv_snapshot's, by core seqs

    # ---- what each kind fills in --------------------------------------------------------
    @abstractmethod
    def label(self, rank: int | None = None) -> str:
        """How errors name a core (or, without a rank, the cores)."""

    @abstractmethod
    def _send(self, rank: int, message: object) -> None:
        """Queue `message` for core `rank` (in order with earlier ones)."""

    @abstractmethod
    def _route(self, request: Request) -> int:
        """Send a new request to the core that takes it (and whatever else that takes); its rank."""

    @abstractmethod
    def _stop_cores(self) -> None:
        """Stop every core and release what it holds; bounded and idempotent."""

    @abstractmethod
    def _check_cores(self) -> None:
        """Raise EngineDeadError if a core is known to be gone (any thread)."""

    def _exited_core(self) -> str | None:  # how a core process exited (read locally), or None
        return None

    def _handle_other(self, message) -> None:
        """A message only a subclass knows (data parallelism's waves); a stray one is dropped."""
        return None

    # ---- start --------------------------------------------------------------------------
    def _wait_started(self) -> None:
        """Every core's CoreReady and first figures, within START_TIMEOUT_S; stops the cores
        and raises EngineDeadError otherwise."""
        try:
            ready: dict[int, CoreReady] = {}
            deadline = time.monotonic() + START_TIMEOUT_S
            while len(ready) < self.size:
                try:
                    message = self._inbox.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    missing = sorted(set(range(self.size)) - set(ready))
                    raise EngineDeadError(f"{self.label()} {missing} did not start within "
                                          f"{START_TIMEOUT_S:.0f} s") from None
                if isinstance(message, CoreFailed):
                    raise EngineDeadError(f"{self.label(message.rank)} failed to start:\n{message.message}")
                if isinstance(message, CoreReady):
                    ready[message.rank] = message
            while any(f is None for f in self._figures):  # every core's first figures
                if time.monotonic() > deadline:
                    raise EngineDeadError(f"{self.label()} sent no figures after starting")
                self._pump(STEP_WAIT_S)
        except BaseException:
            self._stop_cores()
            raise
        self.max_model_len = ready[0].max_model_len
        self.num_kv_blocks = ready[0].num_kv_blocks

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self._check()
        self._owners[request.request_id] = (self._route(request), request)

    def abort_requests(self, request_ids: list[str], status=RequestStatus.FINISHED_ABORTED) -> None:
        by_core: dict[int, list[str]] = {}
        for rid in request_ids:
            owner = self._owners.pop(rid, None)
            if owner is not None:
                by_core.setdefault(owner[0], []).append(rid)
        if self.failure is not None:
            return  # the cores are gone, and their requests with them
        for rank, ids in by_core.items():
            self._send(rank, AbortRequests(tuple(ids), status))

    def step(self) -> list[EngineCoreOutput]:
        self._check()
        if not self._ready:
            self._pump(STEP_WAIT_S)
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
        return None

    # ---- messages from the cores --------------------------------------------------------
    def _pump(self, wait_s: float) -> None:
        """Handle the cores' messages: wait up to `wait_s` for the first, then take the rest."""
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
            if message.kv_events is not None and not self.kv_index.apply(message.rank, message.kv_events):
                self._kv_stale.add(message.rank)
            self._on_step(message)
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
        elif isinstance(message, CallResult):
            self._results[message.call_id] = message
        elif isinstance(message, CoreFailed):
            # A core's collective broke as a peer died, before the peer's exit was read: name the peer.
            self._fail(self._exited_core() or f"{self.label(message.rank)} failed:\n{message.message}")
        else:
            self._handle_other(message)

    def _on_step(self, message: CoreStep) -> None:
        """A core's step arrived (data parallelism notes its queue figures for routing)."""
        return None

    # ---- calls on every core ------------------------------------------------------------
    def _call_all(self, method: str, *args) -> list:
        """method(*args) on every core between its steps; one value per core, in rank order."""
        self._check()
        ids = []
        for rank in range(self.size):
            call_id = next(self._call_ids)
            ids.append(call_id)
            self._send(rank, CoreCall(call_id, method, args))
        deadline = time.monotonic() + _CALL_TIMEOUT_S
        while not all(i in self._results for i in ids):
            if time.monotonic() > deadline:
                self._fail(f"{self.label()} did not answer {method!r} within {_CALL_TIMEOUT_S:.0f} s")
            self._pump(min(STEP_WAIT_S, max(0.0, deadline - time.monotonic())))
            self._check()
        results = [self._results.pop(i) for i in ids]
        for result in results:
            if result.error is not None:
                raise RuntimeError(f"{self.label(result.rank)} failed in {method!r}:\n{result.error}")
        return [r.value for r in results]

    def load(self, fresh: bool = True) -> EngineLoad:
        """The figures of every core as one engine's. `fresh`: asked from every core now (one
        step's wait on the engine thread); otherwise the copies the cores sent with their
        steps (any thread, no wait: what a serving replica reports several times a second)."""
        per_core = self._call_all("load") if fresh else list(self._figures)
        return per_core[0] if self.size == 1 else EngineLoad.summed(per_core)

    def reset_prefix_cache(self) -> bool:
        return all(self._call_all("reset_prefix_cache"))

    def refresh_kv_index(self) -> None:
        """Re-read whole the cores whose KV events had a gap."""
        if self._kv_stale:
            stale, self._kv_stale = self._kv_stale, set()
            for rank, snapshot in enumerate(self._call_all("kv_snapshot")):
                if rank in stale and snapshot is not None:
                    self.kv_index.replace(rank, snapshot)

    def kv_snapshot(self) -> KVSnapshot | None:
        """What all the cores hold, per medium (a block held by several counted once)."""
        if not self.config.cache.enable_kv_cache_events:
            return None
        self.refresh_kv_index()
        seqs = tuple(self.kv_index.seq(rank) or 0 for rank in range(self.size))
        if self._kv_union is None or self._kv_union[0] != seqs:  # built again only when a core moved
            held = {m: tuple(dict.fromkeys(k for rank in range(self.size) for k in self.kv_index.held(rank, m)))
                    for m in MEDIA}
            self._kv_union = (seqs, KVSnapshot(sum(seqs), held))
        return self._kv_union[1]

    def kv_transfer_stats(self) -> dict:
        return summed_counters(self._call_all("kv_transfer_stats"))

    def kv_outbox_size(self) -> int:
        return sum(self._call_all("kv_outbox_size"))

    def give_tokenizer(self, pickled: bytes | None) -> None:
        """Every core builds its grammar backend from the front end's tokenizer (give_tokenizer)."""
        self._call_all("give_tokenizer", pickled)

    # ---- where the cores run (operators and tests) --------------------------------------
    def core_pids(self) -> list[int]:
        """Pids of the cores' processes on this node; empty for cores that are Ray actors."""
        return []

    def core_actors(self) -> list:
        """Handles of the cores' Ray actors; empty for cores that are processes."""
        return []

    def rank_actors(self) -> list:
        """Tensor-parallel rank actors this client holds itself: none (a core holds its own)."""
        return []

    # ---- health and shutdown ------------------------------------------------------------
    def _check(self) -> None:
        silent = self.silence.longest() if self.failure is None else None
        if silent is not None:  # a step or collective over the bound, or a stopped process
            self.failure = (f"{self.label(silent[0])} has been silent for {silent[1]:.0f} s, over "
                            f"engine_step_timeout_s={self.silence.bound_s:g}: hung")
        if self.failure is not None:
            raise EngineDeadError(self.failure)

    def _fail(self, message: str):
        self.failure = message
        self._stop_cores()
        raise EngineDeadError(message)

    def check_health(self) -> None:
        self._check()
        self._check_cores()

    def shutdown(self) -> None:
        self._stop_cores()


class CoreProcClient(CoresClient):
    """One engine core in a child process of its own (engine_core_process), as vLLM V1 runs
    EngineCoreProc: the front end's threads (HTTP, detokenization) then never hold the GIL
    that the engine loop needs between its torch ops."""

    def __init__(self, config: EngineConfig, kv_connector_factory: KVConnectorFactory | None = None) -> None:
        super().__init__(config, 1)
        # Here, before the core starts, so a bad size is the user's ParameterError.
        check_parallel(self.arch, resolve_device(config.model.device), config.parallel)
        if kv_connector_factory is not None and not spawn_safe(kv_connector_factory):
            # A relayed connector (kvstore.transports.relay) crosses into the core's process;
            # one that calls the cluster from wherever it is built cannot.
            raise ParameterError("engine_core_process", "engine_core_process: this KV connector talks to the "
                                 "cluster's KV store from the engine core, which must then stay in the "
                                 "replica's process; a relayed connector (spawn_safe) can run in a core process")
        blocked = process_blocked_signals()  # the replica's, for the core (engine.child_signals)
        self.process = CoreProcess(run_core, (config, torch.get_num_threads(), blocked, kv_connector_factory),
                                   self._inbox, 0, self.label(), "pdserve-core")
        self._stop = reap_at_exit(self, [self.process])
        self._wait_started()

    def label(self, rank: int | None = None) -> str:
        return "the engine core process"

    def _send(self, rank: int, message: object) -> None:
        self.process.send(message)

    def _route(self, request: Request) -> int:
        self._send(0, AddRequest(request, queued_for_s=time.monotonic() - request.arrival_time))
        return 0

    def _stop_cores(self) -> None:
        self._stop()

    def _check_cores(self) -> None:
        self.process.check_health()

    def core_pids(self) -> list[int]:
        return [self.process.pid]

