"""The core's side of a core that runs apart from its front end (vLLM's EngineCoreProc): its
busy loop, and the entry point of a core in a child process.

`CoreLoop`: inputs arrive on a queue (requests, aborts, calls, a stop); after each step the
core sends one CoreStep (that step's outputs, its queue figures, and its load figures when they
changed) to the front end. Nothing else touches the core, so it needs no locks. Data
parallelism extends the loop with waves and dummy batches (engine.dp.core_loop.DPCoreLoop),
and runs it in processes or Ray actors.

`run_core` is a lone core's child process (engine_core_process): it sets the process up, makes
the core, and serves it over its pipe until Shutdown, or until the front end is gone (the pipe
closes). The front end's side of that pipe is engine.core_client.process.CoreProcess.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

from engine.child_signals import apply_blocked_signals
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.core_client.messages import (
    AbortRequests,
    AddRequest,
    CallResult,
    CoreCall,
    CoreFailed,
    CoreReady,
    CoreStep,
    Heartbeat,
    Shutdown,
)
from engine.core_client.watchdog import HEARTBEAT_S
from engine.kv_connector import KVConnectorFactory
from engine.load import EngineLoad
from engine.request import Request
from engine.sched.output import EngineCoreOutput

logger = logging.getLogger(__name__)

# An idle core re-checks its queue this often (it is woken by any input before that), and
# so says it is alive (a Heartbeat) at least every HEARTBEAT_S.
IDLE_WAIT_S = HEARTBEAT_S
# While every request waits for remote KV (P/D decode) or a grammar, the loop polls this often
# in case a wake-up is missed (as engine.async_llm does).
WAITING_POLL_S = 0.05
WAKE = object()  # posted by the KV connector when a load completes: re-check for work
# A stepping core refreshes the front end's copy of its figures at least this often.
FIGURES_EVERY_S = 0.5


class CoreLoop:
    def __init__(self, core: EngineCore, rank: int, send: Callable[[object], None]) -> None:
        self.core = core
        self.rank = rank  # 0 for a lone core; the core's index in a data-parallel group
        self._out = send
        self._sent_at = time.monotonic()
        self.num_requests = 0  # requests routed here since the core started
        # Requests not yet scheduled once: their queue time goes out with their first output.
        self._unscheduled: dict[str, Request] = {}
        self._state: tuple | None = None  # what the last figures sent said (see _figures_due)
        self._figures_at = 0.0
        self._stepped = False  # counters moved since the last figures
        self._stopped = False

    # ---- the loop -----------------------------------------------------------------------
    def run(self, inbox: queue.Queue) -> None:
        try:
            self._publish([])  # the front end's first copy of this core's figures
            while not self._stopped:
                self._drain(inbox)
                if not self._stopped:
                    self._step()
                    self._publish([])  # figures changed by inputs alone (an abort frees blocks)
                    if time.monotonic() - self._sent_at >= HEARTBEAT_S:
                        self.send(Heartbeat(self.rank, [], *self._queue_figures()))
        except Exception:
            if _stop_requested(inbox):
                # Told to stop while in a collective with a peer that stopped first.
                logger.debug("engine core %d stopped mid-step", self.rank)
                return
            logger.exception("engine core %d failed", self.rank)
            self.send(CoreFailed(self.rank, traceback.format_exc()))

    def send(self, message: object) -> None:
        self._sent_at = time.monotonic()
        self._out(message)

    def _step(self) -> None:
        if self.core.has_work():
            self._publish(self.core.step())

    def _wait_s(self) -> float | None:
        """How long the loop may block for its next input: None when it must not block."""
        if not self.core.has_work():
            return IDLE_WAIT_S
        if self.core.idle:
            return WAITING_POLL_S
        return None

    def _drain(self, inbox: queue.Queue) -> None:
        """Handle every queued input; block for the first one only when there is nothing to
        step."""
        timeout = self._wait_s()
        try:
            item = inbox.get(timeout=timeout) if timeout is not None else inbox.get_nowait()
            while True:
                self._handle(item)
                item = inbox.get_nowait()
        except queue.Empty:
            pass

    # ---- inputs -------------------------------------------------------------------------
    def _handle(self, item) -> None:
        if item is WAKE:
            return
        if isinstance(item, AddRequest):
            self._add(item)
        elif isinstance(item, AbortRequests):
            for rid in item.request_ids:
                self._unscheduled.pop(rid, None)
            self.core.abort_requests(list(item.request_ids), item.status)
        elif isinstance(item, CoreCall):
            self._call(item)
        elif isinstance(item, Shutdown):
            self._stopped = True
        elif not self._handle_other(item):
            raise TypeError(f"unexpected message {type(item).__name__}")

    def _handle_other(self, item) -> bool:
        """A message only a subclass knows (data parallelism's waves); False: unknown."""
        return False

    def _add(self, msg: AddRequest) -> bool:
        """Add the request; False when the core refused it (the front end hears of it as the
        request's error output)."""
        request = msg.request
        request.arrival_time = time.monotonic() - msg.queued_for_s
        try:
            self.core.add_request(request)
        except Exception as e:  # the front end validated it: this is the engine's failure, not the user's
            logger.exception("engine core %d could not add %s", self.rank, request.request_id)
            self.send(CoreStep(self.rank, [EngineCoreOutput(request.request_id, [], finish_reason="error",
                                                            stop_reason=repr(e))], *self._queue_figures()))
            return False
        self._unscheduled[request.request_id] = request
        self.num_requests += 1
        return True

    def _call(self, msg: CoreCall) -> None:
        try:
            value = self.figures() if msg.method == "load" else getattr(self.core, msg.method)(*msg.args)
            self.send(CallResult(self.rank, msg.call_id, value))
        except Exception:
            self.send(CallResult(self.rank, msg.call_id, error=traceback.format_exc()))

    def figures(self) -> EngineLoad:
        """The engine's load figures as the front end reports them."""
        return self.core.load()

    # ---- outputs ------------------------------------------------------------------------
    def _queue_figures(self) -> tuple[int, int]:
        return self.core.queue_lengths()

    def _figures_state(self) -> tuple:
        """What, when it changes, makes this core's figures worth sending at once."""
        return *self._queue_figures(), self.core.num_free_blocks(), self.num_requests

    def _figures_due(self) -> EngineLoad | None:
        """This core's figures when the front end's copy is out of date: its queues or free
        blocks changed, or counters moved and FIGURES_EVERY_S passed since the last. The front
        end serves load() from these copies without asking the core."""
        state = self._figures_state()
        now = time.monotonic()
        if state == self._state and not (self._stepped and now - self._figures_at >= FIGURES_EVERY_S):
            return None
        self._state, self._figures_at, self._stepped = state, now, False
        return self.figures()

    def _publish(self, outputs: list[EngineCoreOutput]) -> None:
        if outputs:
            self._stepped = True
        figures = self._figures_due()
        kv_events = getattr(self.core, "last_kv_events", None)  # stand-in cores of tests have none
        if kv_events is not None:
            self.core.last_kv_events = None  # sent once
        if not outputs and figures is None and kv_events is None:
            return
        queue_times: dict[str, float] = {}
        for out in outputs:
            request = self._unscheduled.get(out.request_id)
            if request is not None and request.first_scheduled_time is not None:
                queue_times[out.request_id] = request.first_scheduled_time - request.arrival_time
                del self._unscheduled[out.request_id]
            elif out.finished:
                self._unscheduled.pop(out.request_id, None)
        self.send(CoreStep(self.rank, outputs, *self._queue_figures(), queue_times=queue_times, figures=figures,
                           kv_events=kv_events))


def _stop_requested(inbox: queue.Queue) -> bool:
    """Whether a Shutdown is among the queued inputs (the rest no longer matters)."""
    while True:
        try:
            if isinstance(inbox.get_nowait(), Shutdown):
                return True
        except queue.Empty:
            return False


# ---- a core in a child process -------------------------------------------------------


def prepare_process(blocked_signals: set[int] | None, cuda_devices: str | None, num_threads: int) -> None:
    """First thing in a core process: the replica's signal mask (engine.child_signals), its
    GPUs (before CUDA is first touched) and its share of the CPU threads."""
    apply_blocked_signals(blocked_signals)
    if cuda_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_devices
    torch.set_num_threads(num_threads)


def serve_core(core: EngineCore, rank: int, loop: CoreLoop, conn: Connection) -> None:
    """Announce the core, then run `loop` until Shutdown or until the front end is gone."""
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
    threading.Thread(target=read, name="pdserve-core-input", daemon=True).start()
    loop.run(inbox)


def run_core(config: EngineConfig, num_threads: int, blocked_signals: set[int] | None,
             kv_connector_factory: KVConnectorFactory | None, conn: Connection) -> None:
    """Process entry point of a lone engine core (engine_core_process)."""
    prepare_process(blocked_signals, None, num_threads)
    try:
        # Its front end (LLMEngine, the only maker of core clients) gives it the tokenizer.
        core = EngineCore(config, kv_connector_factory, tokenizer_from_front_end=True)
    except BaseException:
        conn.send(CoreFailed(0, traceback.format_exc()))
        return
    try:
        serve_core(core, 0, CoreLoop(core, 0, conn.send), conn)
    finally:
        core.shutdown()
