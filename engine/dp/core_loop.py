"""One data-parallel engine core's busy loop: the core loop of engine.core_client.core_proc with request
waves and dummy batches (vLLM's DPEngineCoreProc; docs/parallel.md#data-parallel).

Lockstep groups (expert parallelism): every forward pass is a collective over all cores, so
while any core has work every core steps, a core with nothing to run running the model on no
tokens (a dummy batch). Every `sync_every` steps the cores all-reduce whether any has an
unfinished request; when none has, the wave ends: every core pauses and waits for input, and
core 0 tells the front end. The cores count steps from the wave's start and every step is one
forward pass each, so they all reach the all-reduce at the same step. Without lockstep each
core is an independent engine and the loop is the plain one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from engine.core import EngineCore
from engine.core_client.core_proc import CoreLoop
from engine.core_client.messages import AddRequest, StartWave, StartWaveRequest, WaveComplete
from engine.dp.control import DPControlGroup
from engine.load import CoreFigures, EngineLoad

# vLLM all-reduces the "any unfinished" flag every 32 steps: a wave ends at most that many
# dummy steps after the last request finished, and the other steps cost no collective.
SYNC_EVERY = 32


class DPCoreLoop(CoreLoop):
    def __init__(self, core: EngineCore, rank: int, control: DPControlGroup | None,
                 send: Callable[[object], None], sync_every: int = SYNC_EVERY) -> None:
        super().__init__(core, rank, send)
        self.control = control  # None: not lockstep, no waves
        self.sync_every = sync_every
        self.wave = 0
        self.running = False  # in a wave (lockstep only)
        self.steps_in_wave = 0
        self.dummy_steps = 0

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
            self.core.execute_dummy_batch()
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

    def _wait_s(self) -> float | None:
        if self.control is not None and self.running:
            return None  # a lockstep core in a wave always steps
        return super()._wait_s()

    def _handle_other(self, item) -> bool:
        if not isinstance(item, StartWave):
            return False
        if self.control is not None and item.wave >= self.wave:
            self.wave = item.wave
            self.running = True
        return True

    def _add(self, msg: AddRequest) -> bool:
        if not super()._add(msg):
            return False
        if self.control is not None:
            if msg.wave > self.wave:
                self.wave = msg.wave
            elif msg.wave < self.wave and not self.running:
                # Routed in a wave this core already finished: the others paused too. This core
                # runs the new wave from now on even if the request is aborted before it steps.
                self.running = True
                self.send(StartWaveRequest(self.rank, self.wave))
        return True

    def figures(self) -> EngineLoad:
        """The engine's load figures with this core's data-parallel counters."""
        load = self.core.load()
        core = CoreFigures(self.rank, load.waiting, load.running, self.num_requests, self.dummy_steps, self.wave)
        return dataclasses.replace(load, data_parallel=(core,))

    def _figures_state(self) -> tuple:
        return *super()._figures_state(), self.wave
