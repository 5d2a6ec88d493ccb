"""One engine, kept fed from several map_batches calls at once.

A batch actor (`cluster.batch.pipeline.EnginePredictor`) has more than one batch in flight: Ray Data runs
an async UDF's batches of a block concurrently, and the actor takes the next block's call before
the last one is done. `EngineFeeder` owns the actor's engine and steps it on one background
thread; every call hands its rows over with `submit` and awaits one future per row. Rows join
the running engine between steps, so its continuous batching stays full across batch and block
boundaries instead of draining to zero at the end of each batch.

Only the feeder thread touches the engine (adding, stepping, aborting); callers only append to
an inbox under a lock that is never held across a step, so a caller never waits for a step.
A step that raises fails every row in flight and every later `submit` (the job fails; nothing
waits forever).
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future

from engine.engine_request import EngineRequest
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput


class EngineFeeder:
    def __init__(self, engine: LLMEngine, name: str = "batch") -> None:
        self.engine = engine
        self._name = name
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._inbox: list[tuple[EngineRequest, Future]] = []
        self._running: dict[str, Future] = {}  # feeder thread only
        self._error: BaseException | None = None
        self._closed = False
        self.peak_in_flight = 0  # most rows in the engine at once (how full it was kept)
        self._thread = threading.Thread(target=self._loop, name=f"{name}-engine-feeder", daemon=True)
        self._thread.start()

    def next_id(self) -> str:
        """A request id no other row of this feeder has."""
        return f"{self._name}-{next(self._ids)}"

    def submit(self, requests: list[EngineRequest]) -> list[Future]:
        """Queue processed requests (LLMEngine.process; ids from `next_id`); each future
        resolves to its final RequestOutput, or to the ValueError of the engine's check."""
        futures = [Future() for _ in requests]
        with self._cv:
            if self._error is not None:
                raise RuntimeError(f"the engine failed earlier: {self._error!r}") from self._error
            if self._closed:
                raise RuntimeError("the engine feeder is closed")
            self._inbox.extend(zip(requests, futures))
            self._cv.notify()
        return futures

    def generate(self, requests: list[EngineRequest]) -> list[RequestOutput]:
        """Blocking form of `submit` (outputs in input order)."""
        return [f.result() for f in self.submit(requests)]

    def close(self, timeout: float | None = None) -> None:
        """Stop after the rows in flight; idempotent."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _take_inbox(self) -> list | None:
        with self._cv:
            while not self._inbox and not self._running and not self._closed:
                self._cv.wait()
            if self._closed and not self._inbox and not self._running:
                return None
            inbox, self._inbox = self._inbox, []
            return inbox

    def _loop(self) -> None:
        inbox: list = []
        try:
            while (inbox := self._take_inbox()) is not None:
                for request, future in inbox:
                    try:
                        rid = self.engine.add(request)
                    except ValueError as e:  # this row's prompt or parameters: the others go on
                        future.set_exception(e)
                        continue
                    self._running[rid] = future
                self.peak_in_flight = max(self.peak_in_flight, len(self._running))
                for out in self.engine.step():
                    if out.finished and out.request_id in self._running:
                        self._running.pop(out.request_id).set_result(out)
        except BaseException as e:  # noqa: BLE001 - handed to every waiting caller
            with self._cv:
                self._error = e
                pending = [f for _, f in inbox + self._inbox] + list(self._running.values())
                self._inbox, self._running = [], {}
            for future in pending:
                if not future.done():
                    future.set_exception(RuntimeError(f"the engine failed: {e!r}"))
