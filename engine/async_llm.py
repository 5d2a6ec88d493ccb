"""Asyncio streaming front over one LLMEngine: `async for out in engine.generate(...)`.

As vLLM's EngineCoreProc does: one background thread owns the engine and runs a busy loop —
drain the input queue (add / abort / calls), step while there is work, post each output to
its stream's event loop, and block on the input queue when idle. Nothing else steps or changes
the engine, so it needs no locks, and the event loop never waits on a forward pass (it only
reads figures a core apart from this process sent, and which processes or actors hold it).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future

from engine.args import EngineArgs
from engine.config import EngineConfig
from engine.core_client.watchdog import StepClock
from engine.engine_request import EngineRequest
from engine.errors import EngineDeadError
from engine.kv_connector import KVConnectorFactory
from engine.llm_engine import LLMEngine
from engine.load import EngineLoad
from engine.outputs import RequestOutput
from engine.processor import PromptType
from engine.sampling_params import SamplingParams

_STOP = object()
_ABORTED = object()  # posted to a stream whose request was aborted from outside
_WAKE = object()  # external KV arrived: re-check for schedulable work
# While every request waits for remote KV the loop blocks; this bounds the wait in case a
# wake-up is missed.
_IDLE_POLL_S = 0.05


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, kv_connector_factory: KVConnectorFactory | None = None,
                 engine: LLMEngine | None = None) -> None:
        """Over a new LLMEngine for `config` (with a KV connector, if any), or over `engine`."""
        self.engine = engine or LLMEngine(config, kv_connector_factory)
        self._inputs: queue.Queue = queue.Queue()
        self.engine.core.set_kv_wakeup(lambda: self._inputs.put(_WAKE))
        # request id -> (event loop, callable taking each of its outputs on that loop)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, Callable[[object], None]]] = {}
        # Requests added with `submit`: their entry goes when their last output is posted.
        self._sinks: set[str] = set()
        self._errored: BaseException | None = None
        # The hang watchdog of the steps this thread runs (engine.core_client.watchdog); a core
        # apart is watched by its client, whose step() then raises.
        config = config or getattr(self.engine, "config", None)
        self._clock = StepClock(getattr(config, "engine_step_timeout_s", 0), self._hung)
        self._thread = threading.Thread(target=self._busy_loop, name="pdserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, kv_connector_factory: KVConnectorFactory | None = None,
                         usage_context: str = "serving") -> AsyncLLM:
        """An AsyncLLM is what serving code runs, so it takes the serving defaults
        (engine.config.resolved_token_budget) unless told otherwise."""
        return cls(engine_args.create_engine_config(usage_context), kv_connector_factory)

    # ---- engine thread ------------------------------------------------------------------
    def _busy_loop(self) -> None:
        try:
            self._serve_forever()
        except BaseException as e:  # a bug here, not in a step: still fail everything, never hang
            self._die(e)
            raise

    def _hung(self, message: str) -> None:
        """From the watchdog's thread: the engine thread is stuck in a step and cannot fail the
        requests itself."""
        self._die(EngineDeadError(message))

    def _die(self, e: BaseException) -> None:
        """The engine is unusable: fail every stream and queued call, loudly (the replica's
        health check reports `_errored`, so Serve replaces it)."""
        self._errored = e
        for rid in list(self._streams):
            self._post(rid, e)
        self._fail_pending()

    def _serve_forever(self) -> None:
        while True:
            # Block when there is nothing to do: no requests, or the last step found nothing
            # schedulable (all waiting for remote KV; a KV arrival posts _WAKE).
            waiting_only = self.engine.core.idle and self.engine.has_work()
            block = not self.engine.has_work() or waiting_only
            try:
                while True:
                    item = self._inputs.get(block=block, timeout=_IDLE_POLL_S if waiting_only and block else None)
                    block = False
                    if item is _STOP:
                        return
                    if item is not _WAKE:
                        self._handle(item)
            except queue.Empty:
                pass
            if not self.engine.has_work():
                continue
            self._clock.started = time.monotonic()
            try:
                outputs = self.engine.step()
            except Exception as e:
                self._die(e)
                return
            finally:
                self._clock.started = None
            if self._errored is not None:
                return  # declared hung while it ran: its requests were failed already
            self._post_step(outputs)

    def _handle(self, item: tuple[Callable, tuple, Future]) -> None:
        fn, args, fut = item
        # A caller that went away before its call ran cancelled it (asyncio.wrap_future passes
        # the cancellation on): the call is skipped, and its future could take no result. An
        # abort must run whatever its caller does, so callers shield theirs.
        if not fut.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args)
        except BaseException as e:
            fut.set_exception(e)
        else:
            fut.set_result(result)

    def _post(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, put = stream
            loop.call_soon_threadsafe(put, item)

    def _post_step(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs over with one callback per event loop, not one per request:
        the loop then sees the whole step at once (a per-step message can carry all of it)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            by_loop.setdefault(stream[0], []).append((stream[1], out))
            if out.finished and out.request_id in self._sinks:
                self._sinks.discard(out.request_id)
                self._streams.pop(out.request_id, None)
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)

    # ---- callers ------------------------------------------------------------------------
    def call(self, fn: Callable, *args) -> Future:
        """Run fn(*args) on the engine thread between steps; a concurrent Future."""
        fut: Future = Future()
        if self._errored is not None:
            fut.set_exception(EngineDeadError(f"engine is dead: {self._errored!r}"))
        else:
            self._inputs.put((fn, args, fut))
            self.engine.core.wake()  # a data-parallel client may be waiting on its cores
            if self._errored is not None:  # the thread died meanwhile and may have drained before the put
                self._fail_pending()
        return fut

    def _fail_pending(self) -> None:
        """The engine thread is gone: fail every call still queued for it, so no caller (a
        request that arrived while the failing step ran) waits forever."""
        while True:
            try:
                item = self._inputs.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple) and item[2].set_running_or_notify_cancel():
                item[2].set_exception(EngineDeadError(f"engine is dead: {self._errored!r}"))

    def process(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str | None = None,
                **kwargs) -> EngineRequest:
        """The EngineRequest of a prompt (LLMEngine.process): what a caller that holds a prompt,
        not a processed request, hands to `generate`."""
        return self.engine.process(prompt, sampling_params, request_id, **kwargs)

    async def generate(
        self,
        request: EngineRequest,
        *,
        observe: Callable[[RequestOutput], None] | None = None,
        stream_interval_s: float = 0.0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; the last one has `finished=True`. Leaving the loop
        early (client gone, task cancelled) aborts the request and frees its KV blocks.

        Outputs that queued while the caller was busy come out merged as one (as vLLM's
        output collector merges them). `stream_interval_s` > 0 also lets the steps after an
        output gather for that long before the next one (Ray Serve LLM's stream batching: a
        streamed chunk then carries several tokens); the first output and the last are never
        held. `observe` sees each engine step's output as it arrives on this loop, before any
        merging (a replica's latency figures). An engine that died (or hung, past its step
        watchdog) raises EngineDeadError: the request was not at fault."""
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        outputs = _Collector(observe)
        self._streams[request_id] = (loop, outputs.put)
        finished = False
        not_before = None  # loop time before which the next output waits for more steps
        try:
            await asyncio.wrap_future(self.call(self.engine.add, request))
            while not finished:
                item = await outputs.get(not_before)
                if item is _ABORTED:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise EngineDeadError(f"engine failed: {item!r}") from item
                finished = item.finished
                yield item
                if stream_interval_s > 0:
                    not_before = loop.time() + stream_interval_s
        except ValueError:
            finished = True  # rejected by validation: nothing was queued
            raise
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                # Queued at once whatever happens next; then wait for it when we still can.
                fut = self.call(self.engine.abort_request, request_id)
                try:
                    await asyncio.shield(asyncio.wrap_future(fut))
                except (asyncio.CancelledError, RuntimeError):  # EngineDeadError: nothing left to abort
                    pass

    async def submit(self, request: EngineRequest, sink: Callable[[object], None]) -> None:
        """Add a request whose outputs go to `sink` instead of a stream: called on this event
        loop with each RequestOutput (all of one step's in one loop callback), or with the
        exception that killed the engine. Nothing is posted after the finished output, nor
        after `abort`. Validation errors raise here (nothing was queued)."""
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._streams[request_id] = (asyncio.get_running_loop(), sink)
        self._sinks.add(request_id)
        try:
            await asyncio.wrap_future(self.call(self.engine.add, request))
        except BaseException:
            self._sinks.discard(request_id)
            self._streams.pop(request_id, None)
            raise

    async def abort(self, request_id: str) -> None:
        """Abort a request from outside its stream; the stream then ends without a final
        output (nothing is left waiting on it)."""
        if request_id in self._sinks:
            self._sinks.discard(request_id)
            self._streams.pop(request_id, None)
        fut = self.call(self.engine.abort_request, request_id)
        try:
            # Shielded: a caller cancelled meanwhile (Serve cancels a call whose client left)
            # must not cancel the abort itself, or the request would keep its KV blocks.
            await asyncio.shield(asyncio.wrap_future(fut))
        finally:
            self._post(request_id, _ABORTED)

    # ---- what a serving replica asks of its engine (cluster.replica.host) ----------------------
    async def load(self) -> EngineLoad:
        core = self.engine.core
        if core.runs_apart:
            # The figures its cores sent with their steps: no round trip on the engine thread
            # each time Serve asks for routing stats.
            return core.load(fresh=False)
        return await asyncio.wrap_future(self.call(core.load))

    async def kv_transfer_stats(self) -> dict:
        """The KV connector's counters, from wherever its worker side runs."""
        return await asyncio.wrap_future(self.call(self.engine.core.kv_transfer_stats))

    async def kv_outbox_size(self) -> int:
        return await asyncio.wrap_future(self.call(self.engine.core.kv_outbox_size))

    async def kv_snapshot(self):
        """Every prefix block the engine's cores hold, per medium (a KVSnapshot); None when KV
        events are off. On the engine thread: the cores' indexes live there."""
        return await asyncio.wrap_future(self.call(self.engine.core.kv_snapshot))

    def core_pids(self) -> list[int]:
        """Pids of the engine's core processes (engine_core_process, "mp" data-parallel cores)."""
        return self.engine.core.core_pids()

    def core_actors(self) -> list:
        """Handles of the engine's data-parallel core actors ("ray" backend)."""
        return self.engine.core.core_actors()

    def rank_actors(self) -> list:
        """Handles of the engine's tensor-parallel rank actors ("ray" executor)."""
        return self.engine.core.rank_actors()

    async def check_health(self) -> None:
        """Raise if the engine thread died, or a worker is gone (a tensor-parallel rank that
        died, even while idle)."""
        if self._errored is not None:
            raise RuntimeError(f"the engine thread failed: {self._errored!r}")
        # Off the event loop: with rank actors or a core process this asks them (bounded).
        await asyncio.to_thread(self.engine.core.check_health)

    def shutdown(self) -> None:
        self._clock.stop()
        self._inputs.put(_STOP)
        self.engine.core.wake()
        # A thread stuck in a hung step is not waited for: stopping the core (its ranks killed)
        # is what ends that step.
        self._thread.join(timeout=0 if self._clock.fired else 30)
        if self._clock.fired or not self._thread.is_alive():
            self.engine.core.shutdown()


class _Collector:
    """One streamed request's outputs on its event loop: put by the engine thread's callbacks,
    taken by the stream, each output merged with those queued behind it. One future at a time
    waits for it, and a timer only while outputs are held for the interval: no task or
    exception per output (a stream takes one output per engine step)."""

    def __init__(self, observe: Callable[[RequestOutput], None] | None) -> None:
        self._items: deque = deque()
        self._observe = observe
        self._ended = False  # the finished output, an abort or a failure was put
        self._waiter: asyncio.Future | None = None
        self._holding = False  # the waiter waits for the interval's end, not for an item

    def put(self, item) -> None:
        if isinstance(item, RequestOutput):
            if self._observe is not None:
                self._observe(item)
            self._ended = self._ended or item.finished
        else:
            self._ended = True
        self._items.append(item)
        if self._waiter is not None and (not self._holding or self._ended):
            _wake(self._waiter)

    async def get(self, not_before: float | None = None):
        """The next output (with every output queued behind it merged in), or the abort or
        failure that ended the request. With `not_before` (loop time) it lets more steps
        gather until then, unless the request ends meanwhile."""
        loop = asyncio.get_running_loop()
        while True:
            if self._items and (self._ended or not_before is None or loop.time() >= not_before):
                return self._take()
            self._waiter = loop.create_future()
            self._holding = bool(self._items)
            timer = loop.call_at(not_before, _wake, self._waiter) if self._holding else None
            try:
                await self._waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()

    def _take(self):
        item = self._items.popleft()
        if isinstance(item, RequestOutput):
            while not item.finished and self._items and isinstance(self._items[0], RequestOutput):
                item = self._items.popleft().after(item)
        return item


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _deliver(items: list) -> None:
    for put, item in items:
        put(item)
