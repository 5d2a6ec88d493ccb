"""Replica side of the per-step messages (docs/architecture.md#engine-to-front-end).

An engine replica keeps one `IngressChannel` per ingress replica that sent it requests. The
engine hands over each step's outputs in one event-loop callback (AsyncLLM.submit); the
channel turns them into RequestDeltas and wakes the ingress's subscription, which sends
everything gathered since its last message as one list. So a step that advanced 30 requests
of one ingress is one Ray message carrying 30 small deltas, not 30 messages each carrying the
whole prompt and the cumulative output.

With `stream_interval_s` > 0 the subscription waits that long after a message before sending
the next, so a message may carry several steps (the model of Ray Serve LLM's
stream_batching_interval_ms); 0 sends as soon as a step is posted. A request's first delta
and its last are never held back, and go out alone in a message of their own: the first is
the client's time to first token, and the last ends the request, and a closed-loop client
sends its next request only then (held up to an interval, each request left the engine one
slot short for that long). The other deltas keep the interval.

A subscription lives while its ingress has requests here: once none is left (and none comes
within `linger_s`) it ends, and the ingress opens a new one with its next request. Serve thus
sees no request in flight on an idle replica, and a draining replica stops as soon as its
last request finished. If the ingress goes away (the subscription is cancelled), its requests
are aborted here: nothing is left running for nobody.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from engine.outputs import RequestDelta, RequestOutput

LINGER_S = 2.0


class EngineFailed(RuntimeError):
    """The replica's engine died: every request it held is lost (the ingress fails them)."""


class IngressChannel:
    def __init__(self) -> None:
        self.active: set[str] = set()
        self.fresh: set[str] = set()  # active requests that have had no delta yet
        self.pending: dict[str, RequestDelta] = {}  # request id -> delta since the last message
        self.urgent: set[str] = set()  # pending requests whose delta is their first or last
        self.error: BaseException | None = None
        self.wake = asyncio.Event()
        self._urgent_waiter: asyncio.Future | None = None

    def add(self, request_id: str) -> None:
        self.active.add(request_id)
        self.fresh.add(request_id)

    def discard(self, request_id: str) -> None:
        self.active.discard(request_id)
        self.fresh.discard(request_id)
        self.urgent.discard(request_id)
        self.pending.pop(request_id, None)

    def put(self, out) -> None:
        if isinstance(out, BaseException):
            self.error = out
            self._cut_hold()
        elif out.request_id in self.active:
            rid = out.request_id
            delta = RequestDelta.of(out)
            held = self.pending.get(rid)
            if held is None:
                self.pending[rid] = delta
            else:
                held.merge(delta)
            if out.finished or (rid in self.fresh and delta.token_ids):
                self.fresh.discard(rid)
                self.urgent.add(rid)
                self._cut_hold()
            if out.finished:
                self.active.discard(rid)
        else:
            return  # aborted meanwhile: its late outputs are nobody's
        self.wake.set()

    def _cut_hold(self) -> None:
        if self._urgent_waiter is not None and not self._urgent_waiter.done():
            self._urgent_waiter.set_result(None)

    async def hold(self, seconds: float) -> None:
        """Wait up to `seconds` for more deltas to gather, less if an urgent one (or the
        engine's error) arrives."""
        if self.urgent or self.error is not None:
            return
        self._urgent_waiter = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(self._urgent_waiter, seconds)
        except asyncio.TimeoutError:
            pass  # the interval is over: send what gathered
        finally:
            self._urgent_waiter = None

    def take(self) -> list[RequestDelta]:
        """Every pending delta (the interval is over)."""
        batch = list(self.pending.values())
        self.pending.clear()
        self.urgent.clear()
        return batch

    def take_urgent(self) -> list[RequestDelta]:
        """Only the first and last deltas; the others keep waiting for the interval (at high
        concurrency some request starts or ends in nearly every step, and sending everything
        then would undo the coalescing)."""
        batch = [self.pending.pop(rid) for rid in self.urgent if rid in self.pending]
        self.urgent.clear()
        return batch


class StepHub:
    """All ingress channels of one engine replica."""

    def __init__(self, stream_interval_s: float = 0.0, linger_s: float = LINGER_S,
                 on_output: Callable[[RequestOutput], None] | None = None) -> None:
        self.stream_interval_s = stream_interval_s
        self.linger_s = linger_s
        self.on_output = on_output  # per-request figures (TTFT, ITL) of the replica
        self.channels: dict[str, IngressChannel] = {}
        self.owner: dict[str, str] = {}  # request id -> ingress id

    def _channel(self, ingress_id: str) -> IngressChannel:
        ch = self.channels.get(ingress_id)
        if ch is None:
            ch = self.channels[ingress_id] = IngressChannel()
        return ch

    def sink(self, ingress_id: str, request_id: str) -> Callable[[object], None]:
        """Register a request of `ingress_id`; the callable goes to AsyncLLM.submit."""
        ch = self._channel(ingress_id)
        ch.add(request_id)
        self.owner[request_id] = ingress_id
        on_output = self.on_output

        def put(out) -> None:
            if on_output is not None and not isinstance(out, BaseException):
                on_output(out)
            ch.put(out)
            if isinstance(out, BaseException) or out.finished:
                self.owner.pop(request_id, None)
        return put

    def forget(self, request_id: str) -> None:
        """The request was aborted (or never queued): no delta of it goes out any more."""
        ingress_id = self.owner.pop(request_id, None)
        ch = self.channels.get(ingress_id) if ingress_id is not None else None
        if ch is not None:
            ch.discard(request_id)

    async def subscribe(self, ingress_id: str, abort: Callable[[str], Awaitable[None]]
                        ) -> AsyncIterator[list[RequestDelta]]:
        """The message stream of one ingress replica (a Serve streaming method's body)."""
        ch = self._channel(ingress_id)
        last_sent = 0.0
        ended = False
        try:
            while True:
                if not ch.pending and ch.error is None:
                    if not ch.active:
                        try:
                            await asyncio.wait_for(ch.wake.wait(), self.linger_s)
                        except asyncio.TimeoutError:
                            pass
                        if not ch.active and not ch.pending and ch.error is None:
                            ended = True
                            return  # idle: the ingress reopens with its next request
                    else:
                        await ch.wake.wait()
                ch.wake.clear()
                if ch.error is not None:
                    ended = True
                    raise EngineFailed(f"engine failed: {ch.error!r}")
                wait = last_sent + self.stream_interval_s - time.monotonic()
                if wait > 0:
                    await ch.hold(wait)  # coalescing interval (a rate, not a synchronisation)
                    if ch.error is not None:
                        continue  # raised at the top of the loop
                    if time.monotonic() < last_sent + self.stream_interval_s:
                        # Cut short by a first or last delta: send those alone; the others
                        # keep the interval's schedule (last_sent unchanged).
                        batch = ch.take_urgent()
                        if batch:
                            yield batch
                        continue
                batch = ch.take()
                if batch:
                    last_sent = time.monotonic()
                    yield batch
        finally:
            if not ended:
                # Cancelled: the ingress is gone (or gave up on this stream). Its requests here
                # would run for nobody and hold KV blocks: abort them.
                for rid in list(ch.active):
                    self.forget(rid)
                    # Not awaited: a closing generator must not wait on the engine thread.
                    asyncio.ensure_future(abort(rid))
            if not ch.active and not ch.pending and self.channels.get(ingress_id) is ch:
                del self.channels[ingress_id]
