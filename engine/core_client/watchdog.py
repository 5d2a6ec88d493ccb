"""The engine hang watchdog: a step, a collective or a core process that stops making progress
fails the engine within `engine_step_timeout_s`, instead of holding its requests forever.

A dead process is seen at once (its pipe closes, its sentinel fires); a live one that stopped
answering is not: a stuck collective, a deadlock, a process stopped by SIGSTOP or a debugger.
Two clocks catch those:

- `StepClock`, where the engine thread runs its core's steps itself (AsyncLLM over an
  in-process core, whatever its executor): when the current step started, and a thread that
  reports a step running longer than the bound. The engine thread cannot be interrupted, so
  the engine is failed from this thread (engine.async_llm: every stream and call ends with an
  error, the health check fails).
- `Silence`, where the cores run apart (engine.core_client.client): when each core was last
  heard from. A core's loop sends something at least every HEARTBEAT_S, idle or not
  (engine.core_client.core_proc), so a silence longer than the bound is a step that long or a
  loop that no longer runs. The client then fails as for a dead core.

docs/operations.md#engine-hang-watchdog says how to choose the bound.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from engine.core_client.messages import CoreStep, Heartbeat
from engine.load import EngineLoad

# How often a core's loop says it is alive when it has nothing else to send.
HEARTBEAT_S = 0.5
# The watchdog thread looks this often (at most; a quarter of a smaller bound).
_LOOK_EVERY_S = 1.0


class StepClock:
    """When the engine thread's current step started; `on_hung(message)` is called once, from
    a thread of its own, when one has run longer than `bound_s` (0: never)."""

    def __init__(self, bound_s: float, on_hung: Callable[[str], None]) -> None:
        self.bound_s = bound_s
        self.started: float | None = None  # set by the engine thread around each step
        self._on_hung = on_hung
        self._stop = threading.Event()
        self.fired = False
        if bound_s:
            threading.Thread(target=self._watch, name="pdserve-engine-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.wait(min(_LOOK_EVERY_S, self.bound_s / 4)):
            started = self.started
            if started is not None and time.monotonic() - started > self.bound_s:
                self.fired = True
                self._on_hung(f"an engine step has run for {time.monotonic() - started:.0f} s, over "
                              f"engine_step_timeout_s={self.bound_s:g}: a hung step or collective")
                return

    def stop(self) -> None:
        self._stop.set()


class Silence:
    """When each of `size` cores was last heard from (any thread notes, any thread checks)."""

    def __init__(self, size: int, bound_s: float) -> None:
        self.bound_s = bound_s
        self._heard = [time.monotonic()] * size

    def heard(self, rank: int) -> None:
        self._heard[rank] = time.monotonic()

    def longest(self) -> tuple[int, float] | None:
        """(rank, seconds) of a core silent for longer than the bound, or None."""
        if not self.bound_s:
            return None
        now = time.monotonic()
        rank = min(range(len(self._heard)), key=self._heard.__getitem__)
        silent = now - self._heard[rank]
        return (rank, silent) if silent > self.bound_s else None


class CoreInbox(queue.Queue):
    """The cores' messages for their client, noting each core's figures and when it was last
    heard from as they arrive (from the threads that receive them, so both are current even
    while nothing drives the client). A Heartbeat says no more: it is not queued."""

    def __init__(self, figures: list[EngineLoad | None], silence: Silence) -> None:
        super().__init__()
        self._figures, self._silence = figures, silence

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        if getattr(item, "rank", None) is not None:
            self._silence.heard(item.rank)
        if isinstance(item, Heartbeat):
            return
        if isinstance(item, CoreStep) and item.figures is not None:
            self._figures[item.rank] = item.figures
        super().put(item, block, timeout)
