"""KV handed back with the prefill's reply, when the requester hosts the decode engine.

With direct streaming in P/D (cluster.replica.server) the ingress replica that asks a Prefill replica
for a prompt's first token also runs the decode engine that will load the prompt's KV. The
store then adds nothing but calls: the prefill would put the bytes and register them, the
decode side would look them up, fetch and release them (three actor calls and the object
store's borrowing protocol per request). Instead the prefill replica returns the bytes in its
reply, and the ingress hands them to its own decode transport's inbox, where the consumer's
fetch finds them. No store entry, no lease: the bytes live in the ingress until its decode
request loaded them, or until the request ended (the P/D flow's cleanup drops them), and a
prefill replica that dies after replying loses nothing (Ray's caller owns a reply).

`Handbacks` is the producer's side (exports expected back in a reply), `Inbox` the
consumer's (exports received in a reply, waiting for their load). Both are thread-safe: the
engine thread, a KV relay's thread and the replica's event loop all reach them.
"""

from __future__ import annotations

import math
import os
import threading
import time
import zlib
from dataclasses import dataclass

import torch

from engine.outputs import RequestOutput
from kvstore.kv_io import MalformedKV


@dataclass(frozen=True)
class ExportFailed:
    """An export that failed, handed back instead of its bytes: the consumer then fails or
    recomputes at once, as a store lookup would have told it."""

    reason: str


@dataclass(frozen=True)
class Declined:
    """Handbacks.poll/take: the export was too big for a reply and went to the store (every
    instance equals every other: it carries nothing)."""


DECLINED = Declined()
# What an export turned into, for a reply: its bytes or its failure; on the requester's side
# also bytes refused because they did not match their meta (KVHandoff's rebuild).
HandedKV = torch.Tensor | ExportFailed | MalformedKV
# The channel a reply travels on: with Serve's throughput-optimised mode (cluster.launch.serve_env)
# calls between deployments are gRPC, whose client refuses a message over this many bytes
# (Serve's default 4 MiB; pdserve sets 128 MiB). A prompt's KV above the limit less some room
# for the rest of the reply goes through the store (the object store has no such limit).
GRPC_MAX_MESSAGE = "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"
_GRPC_DEFAULT = 4 * 1024 * 1024
_REPLY_ROOM = 1024 * 1024  # the RequestOutput beside the KV (a 32k-token prompt's ids: ~0.3 MB)


def max_reply_kv_bytes(environ=None) -> int:
    """The largest prompt KV a prefill's reply may carry in this cluster."""
    env = os.environ if environ is None else environ
    return max(0, int(env.get(GRPC_MAX_MESSAGE, _GRPC_DEFAULT)) - _REPLY_ROOM)


@dataclass(frozen=True)
class KVHandoff:
    """A prefill's reply with its prompt KV (`kv`), or why the export failed (`error`). Both
    None: the replica could not hand it back (tensor or data parallel, or the export came
    after the reply was due) and registered it in the store as usual. `refused`: the KV
    arrived but its bytes did not match their meta (a kvstore.kv_io refusal reason; `error`
    says how), so the requester's load fails without them."""

    output: RequestOutput | None
    kv: torch.Tensor | None = None
    error: str | None = None
    refused: str | None = None

    def __reduce__(self):
        # The KV as raw bytes in a numpy array, where torch's own pickling of a tensor goes
        # through torch.save (1 MB, the small preset's 256-token prompt: 522 us to pickle and
        # unpickle against 10 us out of band, measured). Ray's serializer ships the buffer out
        # of band (pickle protocol 5); Serve's gRPC path (cloudpickle, no buffer callback)
        # writes it in band as one flat byte string, still one plain copy each way. Bytes,
        # not values: numpy has no bfloat16. Their crc32 goes beside them: one more pass over
        # them on each side (zlib, about a copy's speed), against a reply that arrives garbled.
        if self.kv is None:
            return (KVHandoff, (self.output, None, self.error, self.refused))
        kv = self.kv.contiguous()
        raw = kv.reshape(-1).view(torch.uint8).numpy()
        return (_rebuild, (self.output, raw, str(kv.dtype).removeprefix("torch."), tuple(kv.shape), self.error,
                           zlib.crc32(raw)))

    @property
    def handed_off(self) -> bool:
        return self.kv is not None or self.error is not None

    @property
    def value(self) -> HandedKV | None:
        if self.kv is not None:
            return self.kv
        if self.refused is not None:
            return MalformedKV(self.refused, self.error)
        return ExportFailed(self.error) if self.error is not None else None


def _rebuild(output, raw, dtype: str, shape: tuple, error, crc32: int) -> KVHandoff:
    # Bytes that do not match their meta are refused here, not failed in unpickling: the
    # reply's output still arrives, and the load fails (the failure policy applies).
    expected = math.prod(shape) * getattr(torch, dtype).itemsize
    if raw.nbytes != expected:
        return KVHandoff(output, None, f"the reply's KV has {raw.nbytes} bytes, its {dtype} {list(shape)} "
                                       f"needs {expected}", refused="bytes")
    if zlib.crc32(raw) != crc32:
        return KVHandoff(output, None, f"the reply's KV bytes do not match their crc32 ({crc32:#010x})",
                         refused="bytes")
    # A buffer Ray hands over may be read-only (shared memory): copy it then, as torch
    # tensors must be writable.
    data = torch.from_numpy(raw if raw.flags.writeable else raw.copy())
    return KVHandoff(output, data.view(getattr(torch, dtype)).reshape(shape), error)


class Handbacks:
    """Producer side: transfer ids whose export goes back in the prefill's reply."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._expected: dict[str, threading.Event] = {}
        self._ready: dict[str, HandedKV | Declined] = {}
        self._max_bytes: dict[str, int] = {}  # the requester's bound on the KV in its reply

    def expect(self, transfer_id: str, max_bytes: int | None = None) -> None:
        """Expect `transfer_id`'s export back in the reply. `max_bytes`: the largest KV the
        requester's channel takes (kvstore.handoff.max_reply_kv_bytes in *its* process: the
        client's gRPC limit is the one that refuses a reply); a bigger export is declined."""
        with self._lock:
            self._expected[transfer_id] = threading.Event()
            if max_bytes is None:
                self._max_bytes.pop(transfer_id, None)
            else:
                self._max_bytes[transfer_id] = max_bytes

    def offer(self, transfer_id: str, value: HandedKV, nbytes: int = 0, limit: int | None = None) -> bool:
        """Keep an export (or its failure) for the reply; False if nobody expects it, or if its
        `nbytes` exceed `limit` (this side's channel) or the requester's bound: then it goes
        to the store, and the reply says so at once (`DECLINED`) instead of waiting for it."""
        with self._lock:
            event = self._expected.get(transfer_id)
            if event is None:
                return False
            bounds = [b for b in (limit, self._max_bytes.get(transfer_id)) if b is not None]
            fits = not bounds or nbytes <= min(bounds)
            self._ready[transfer_id] = value if fits else DECLINED
        event.set()
        return fits

    def poll(self, transfer_id: str) -> HandedKV | Declined | None:
        """The export if it is here (then no longer expected), else None (still expected)."""
        with self._lock:
            value = self._ready.pop(transfer_id, None)
            if value is not None:
                del self._expected[transfer_id]
                self._max_bytes.pop(transfer_id, None)
            return value

    def take(self, transfer_id: str, timeout_s: float = 0.0) -> HandedKV | Declined | None:
        """The export for the reply, waiting up to `timeout_s` for it (a core in a child
        process publishes through a relay thread that may run behind its outputs); None if it
        did not come. Either way the id is no longer expected: an export that comes later is
        registered in the store, where the consumer's lookup finds it."""
        with self._lock:
            event = self._expected.get(transfer_id)
        if event is not None and timeout_s > 0:
            event.wait(timeout_s)
        with self._lock:
            event = self._expected.pop(transfer_id, None)
            value = self._ready.pop(transfer_id, None)
            self._max_bytes.pop(transfer_id, None)
        if event is not None:
            event.set()  # a thread still waiting for it (its request was cancelled) stops now
        return value

    def __len__(self) -> int:
        with self._lock:
            return len(self._ready)


class Inbox:
    """Consumer side: exports received in a prefill's reply, until their load took them and
    released them, or the request's flow forgot them. An entry older than `ttl_s` (the
    store's lease: a request that waited that long for its load would find a store transfer
    expired too) is dropped at the next delivery or count (the replica counts its handoffs in
    every load report, a few seconds apart even when idle), so a path that never forgets one
    cannot hold its bytes for ever."""

    def __init__(self, ttl_s: float = 120.0, clock=time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        # Insertion order is expiry order (one ttl): deadline, value.
        self._waiting: dict[str, tuple[float, HandedKV]] = {}
        self._taken: dict[str, float] = {}  # fetched, not yet released: deadline

    def deliver(self, transfer_id: str, value: HandedKV) -> None:
        now = self._clock()
        with self._lock:
            self._sweep(now)
            self._waiting[transfer_id] = (now + self.ttl_s, value)

    def _sweep(self, now: float) -> None:
        # Waiting entries are in delivery order, which is deadline order: stop at the first
        # live one. Taken ones are in claim order: look at each (a few, briefly held).
        while self._waiting and next(iter(self._waiting.values()))[0] <= now:
            del self._waiting[next(iter(self._waiting))]
        for transfer_id in [t for t, deadline in self._taken.items() if deadline <= now]:
            del self._taken[transfer_id]

    def claim(self, transfer_id: str) -> HandedKV | None:
        """The delivered value, or None (not handed off: fetch it from the store)."""
        with self._lock:
            entry = self._waiting.pop(transfer_id, None)
            if entry is None:
                return None
            self._taken[transfer_id] = entry[0]
            return entry[1]

    def forget(self, transfer_id: str) -> bool:
        """Drop a transfer (released after its load, or its request ended); False if it was
        never handed off here (a store transfer: release it there)."""
        with self._lock:
            taken = self._taken.pop(transfer_id, None) is not None
            return self._waiting.pop(transfer_id, None) is not None or taken

    def __len__(self) -> int:
        with self._lock:
            self._sweep(self._clock())
            return len(self._waiting) + len(self._taken)
