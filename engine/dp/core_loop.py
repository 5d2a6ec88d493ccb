"""One data-parallel engine core's busy loop (seed 004's DPEngineCoreProc).

Inputs arrive on a queue (requests, aborts, wave starts, calls); after each step the core sends
one CoreStep (that step's outputs and its queue figures) to the front end.

Lockstep groups (expert parallelism): every forward pass is a collective over all cores, so
while any core has work every core steps, a core with nothing to run running the model on no
tokens (a dummy batch). Every `sync_every` steps the cores all-reduce whether any has an
unfinished request; when none has, the wave ends: every core pauses and waits for input, and
core 0 tells the front end. The cores count steps from the wave's start and every step is one
forward pass each, so they all reach the all-reduce at the same step.
"""

from __future__ import annotations

import logging
import queue
import time
import traceback
from collections.abc import Callable

from engine.core import EngineCore
from engine.dp.control import DPControlGroup
from engine.dp.messages import (
    AbortRequests,
    AddRequest,
    CallResult,
    CoreCall,
    CoreFailed,
    CoreStep,
    Shutdown,
    StartWave,
    StartWaveRequest,
    WaveComplete,
)
from engine.request import Request
from engine.sched.output import EngineCoreOutput

logger = logging.getLogger(__name__)

# An idle core re-checks its queue this often (it is woken by any input before that).
_IDLE_WAIT_S = 1.0
# While every request waits for remote KV (P/D decode) or a grammar, the loop polls this often
# in case a wake-up is missed (as engine.async_llm does).
_WAITING_POLL_S = 0.05
WAKE = object()  # posted by the KV connector when a load completes: re-check for work
# vLLM all-reduces the "any unfinished" flag every 32 steps: a wave ends at most that many
# dummy steps after the last request finished, and the other steps cost no collective.
SYNC_EVERY = 32
# A stepping core refreshes the front end's copy of its counters at least this often.
FIGURES_EVERY_S = 0.5


class DPCoreLoop:
    def __init__(self, core: EngineCore, rank: int, control: DPControlGroup | None,
                 send: Callable[[object], None], sync_every: int = SYNC_EVERY) -> None:
        self.core = core
        self.rank = rank
        self.control = control  # None: not lockstep, no waves
        self.send = send
        self.sync_every = sync_every
        self.wave = 0
        self.running = False  # in a wave (lockstep only)
        self.steps_in_wave = 0
        self.dummy_steps = 0
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
        except Exception:
            if _stop_requested(inbox):
                # Told to stop while in a collective with a peer that stopped first.
                logger.debug("data-parallel core %d stopped mid-step", self.rank)
                return
            logger.exception("data-parallel core %d failed", self.rank)
            self.send(CoreFailed(self.rank, traceback.format_exc()))

    def _step(self) -> None:
        ran_model = False
        if self.core.has_work():
            outputs = self.core.step()
            ran_model = self.core.last_step_ran_model
            self._publish(outputs)
        if self.control is None:
            return
        unfinished = self.core.has_unfinished_requests()
        if not ran_model:
            if not unfinished and not self.running:
                return  # the group is paused and so is this core
            self.core.executor.execute_dummy_batch()
            self.dummy_steps += 1
            self._stepped = True
        self.steps_in_wave += 1
        self.running = self.steps_in_wave % self.sync_every != 0 or self.control.any(unfinished)
        if not self.running:
            if self.rank == 0:
                self.send(WaveComplete(self.wave))
            self.wave += 1
            self.steps_in_wave = 0
            self._publish([])  # the wave's last figures (its dummy steps), before pausing

    def _drain(self, inbox: queue.Queue) -> None:
        """Handle every queued input; block for the first one only when there is nothing to
        step (a lockstep core in a wave always steps)."""
        timeout: float | None = None
        if not (self.control is not None and self.running):
            if not self.core.has_work():
                timeout = _IDLE_WAIT_S
            elif self.core.idle:
                timeout = _WAITING_POLL_S
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
        elif isinstance(item, StartWave):
            if self.control is not None and item.wave >= self.wave:
                self.wave = item.wave
                self.running = True
        elif isinstance(item, CoreCall):
            self._call(item)
        elif isinstance(item, Shutdown):
            self._stopped = True
        else:
            raise TypeError(f"unexpected message {type(item).__name__}")

    def _add(self, msg: AddRequest) -> None:
        request = msg.request
        request.arrival_time = time.monotonic() - msg.queued_for_s
        try:
            self.core.add_request(request)
        except Exception as e:  # the front end validated it: this is the engine's failure, not the user's
            logger.exception("data-parallel core %d could not add %s", self.rank, request.request_id)
            self.send(CoreStep(self.rank, [EngineCoreOutput(request.request_id, [], finish_reason="error",
                                                            stop_reason=repr(e))], *self._queue_figures()))
            return
        self._unscheduled[request.request_id] = request
        self.num_requests += 1
        if self.control is not None:
            if msg.wave > self.wave:
                self.wave = msg.wave
            elif msg.wave < self.wave and not self.running:
                # Routed in a wave this core already finished: the others paused too. This core
                # runs the new wave from now on even if the request is aborted before it steps.
                self.running = True
                self.send(StartWaveRequest(self.rank, self.wave))

    def _call(self, msg: CoreCall) -> None:
        try:
            value = self.figures() if msg.method == "load" else getattr(self.core, msg.method)(*msg.args)
            self.send(CallResult(self.rank, msg.call_id, value))
        except Exception:
            self.send(CallResult(self.rank, msg.call_id, error=traceback.format_exc()))

    def figures(self) -> dict:
        """The engine's load figures and this core's data-parallel counters."""
        return {**self.core.load(), "dp_dummy_steps": self.dummy_steps, "dp_wave": self.wave,
                "dp_requests": self.num_requests}

    # ---- outputs ------------------------------------------------------------------------
    def _queue_figures(self) -> tuple[int, int]:
        scheduler = self.core.scheduler
        return len(scheduler.waiting), len(scheduler.running)

    def _figures_due(self) -> dict | None:
        """This core's figures when the front end's copy is out of date: its queues, free
        blocks or wave changed, or counters moved and FIGURES_EVERY_S passed since the last.
        The front end serves load() from these copies without asking every core."""
        state = (*self._queue_figures(), self.core.kv_cache_manager.get_num_free_blocks(), self.wave,
                 self.num_requests)
        now = time.monotonic()
        if state == self._state and not (self._stepped and now - self._figures_at >= FIGURES_EVERY_S):
            return None
        self._state, self._figures_at, self._stepped = state, now, False
        return self.figures()

    def _publish(self, outputs: list[EngineCoreOutput]) -> None:
        if outputs:
            self._stepped = True
        figures = self._figures_due()
        if not outputs and figures is None:
            return
        queue_times: dict[str, float] = {}
        for out in outputs:
            request = self._unscheduled.get(out.request_id)
            if request is not None and request.first_scheduled_time is not None:
                queue_times[out.request_id] = request.first_scheduled_time - request.arrival_time
                del self._unscheduled[out.request_id]
            elif out.finished:
                self._unscheduled.pop(out.request_id, None)
        self.send(CoreStep(self.rank, outputs, *self._queue_figures(), queue_times=queue_times, figures=figures))


def _stop_requested(inbox: queue.Queue) -> bool:
    """Whether a Shutdown is among the queued inputs (the rest no longer matters)."""
    while True:
        try:
            if isinstance(inbox.get_nowait(), Shutdown):
                return True
        except queue.Empty:
            return False
