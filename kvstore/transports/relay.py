"""A transport relayed over a pipe: the P/D connector of an engine core in a child process.

An engine core in a process of its own (`engine_core_process`, engine.dp.mp_cores) is not a
Ray worker: it cannot call the KV store actor or read the object store. Its connector sides
run there as usual (the scheduler side beside the Scheduler, the worker side beside the model
runner, which owns the paged cache), but their transport is a `RelayTransport`, which sends
each call (publish, abandon, fetch, release) to the `KVRelay` in the replica's process; that
runs it on the real transport (kvstore.transports.object_store) and sends a fetch's bytes
back. So the connector keeps every rule it has (fetches off the engine thread, loads written
between steps, failure policy, release exactly once), and the replica's process, a Ray
worker, keeps every call into Ray, as it does for an in-process core.

On the pipe a tensor is a small header (dtype, shape, crc32) followed by its raw bytes, received
straight into a new tensor's memory: no pickling of the data. Bytes whose count differs from
the header's leave the pipe out of step (it is closed); bytes that do not match their crc32 are
refused (kvstore.kv_io.MalformedKV) and the pipe goes on. A pipe that closes ends the relay on
both sides: the core's pending fetches fail (TransferError), and the replica's relay thread
exits.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

from engine.kv_transfer_params import KVTransferParams
from kvstore.connector import PDConnector
from kvstore.kv_io import MalformedKV, check_bytes, kv_crc32
from kvstore.transports.base import KVTransport, TransferError

logger = logging.getLogger(__name__)


class _Wire:
    """One end of the relay pipe: typed messages, a tensor as header + raw bytes, sends from
    any thread (each header and its bytes stay together). Its reading thread closes it as it
    exits; other threads only `shutdown` it, so no thread ever uses a descriptor that was
    closed (and perhaps reused) under it."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()  # one sender at a time; the close waits for it
        self._fd_lock = threading.Lock()  # shutdown and close never overlap

    def send(self, *message) -> None:
        with self._lock:
            self.conn.send(message)

    def send_tensor(self, head: tuple, kv: torch.Tensor) -> None:
        kv = kv.detach().to("cpu").contiguous()
        raw = kv.view(torch.uint8).reshape(-1) if kv.numel() else torch.empty(0, dtype=torch.uint8)
        crc32 = kv_crc32(kv)  # before the lock: other senders need not wait for it
        with self._lock:
            self.conn.send((*head, str(kv.dtype).removeprefix("torch."), tuple(kv.shape), crc32))
            self.conn.send_bytes(raw.numpy())

    def recv(self) -> tuple:
        return self.conn.recv()

    def recv_tensor(self, dtype: str, shape: tuple, crc32: int) -> torch.Tensor:
        """The tensor whose header was just received; MalformedKV if its bytes do not match
        the header's crc32 (they were all read: the pipe stays in step)."""
        kind = getattr(torch, dtype)
        out = torch.empty(shape, dtype=kind)
        raw = out.view(torch.uint8).reshape(-1) if out.numel() else torch.empty(0, dtype=torch.uint8)
        n = self.conn.recv_bytes_into(raw.numpy())
        if n != raw.numel():
            raise TransferError(f"relayed KV had {n} bytes, its header said {raw.numel()}")
        check_bytes(out, None, crc32, "the KV relay")
        return out

    def shutdown(self) -> None:
        """Any thread: end the pipe both ways, waking this end's blocked reader and senders
        (a plain close would not: a blocked read keeps the socket open, and the other end
        would never see it go)."""
        with self._fd_lock:
            if self.conn.closed:
                return
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(self.conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """The reading thread, as it exits: once no send is under way."""
        with self._lock, self._fd_lock:
            self.conn.close()


class RelayTransport(KVTransport):
    """The core process's side: every call goes to the replica's KVRelay. If its pipe breaks
    or garbles, every fetch waiting or asked for fails at once (TransferError) and exports
    raise; the replica sees the pipe close, and its health check fails. It owns `conn` (its
    reading thread closes it), as a KVRelay owns its end."""

    def __init__(self, conn: Connection, name: str) -> None:
        self.name = name  # the real transport's: it is what the exported params name
        self._wire = _Wire(conn)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._waiting: dict[int, Callable[[object], None]] = {}
        self._closed: str | None = None
        threading.Thread(target=self._read, name="pdserve-kv-relay", daemon=True).start()

    def publish(self, transfer_id: str, kv: torch.Tensor, num_tokens: int) -> None:
        # Raising is what the connector expects of a failed hand-over: it abandons the export.
        if self._closed is not None:
            raise TransferError(self._closed)
        try:
            self._wire.send_tensor(("publish", transfer_id, num_tokens), kv)
        except OSError as e:
            raise TransferError(f"the replica's KV relay is gone: {e}") from e

    def abandon(self, transfer_id: str, reason: str) -> None:
        self._send_or_drop("abandon", transfer_id, reason)

    def release(self, params: KVTransferParams) -> None:
        self._send_or_drop("release", params)

    def _send_or_drop(self, *message) -> None:
        try:
            self._wire.send(*message)
        except OSError:
            pass  # the replica is gone: the store's lease ends the transfer

    def fetch_async(self, params: KVTransferParams, on_done: Callable[[object], None]) -> None:
        with self._lock:
            closed = self._closed
            if closed is None:
                fetch_id = next(self._ids)
                self._waiting[fetch_id] = on_done
        if closed is not None:
            on_done(TransferError(closed))
            return
        try:
            self._wire.send("fetch", fetch_id, params)
        except Exception as e:  # never a load left waiting for an answer that cannot come
            self._answered(fetch_id, TransferError(f"the replica's KV relay is gone: {e}"))

    @property
    def outbox_size(self) -> int:
        return 0  # exports are held by the replica's transport, which answers for them

    def _read(self) -> None:
        reason = "the replica's KV relay is gone"
        try:
            while True:
                kind, fetch_id, *rest = self._wire.recv()
                try:
                    result = self._wire.recv_tensor(*rest) if kind == "fetched" else TransferError(rest[0])
                except MalformedKV as e:
                    result = e  # that fetch's load is refused (counted by the connector)
                self._answered(fetch_id, result)
        except (EOFError, OSError) as e:
            reason += f" ({type(e).__name__})"
        except Exception as e:  # a garbled pipe (or no memory for a tensor): nothing after it is trusted
            logger.exception("KV relay: unreadable message from the replica")
            reason += f" (unreadable message: {e})"
        finally:
            with self._lock:
                self._closed = reason
                waiting, self._waiting = self._waiting, {}
            self._wire.shutdown()  # the replica sees it at once
            self._wire.close()
            for on_done in waiting.values():
                _call(on_done, TransferError(reason))

    def _answered(self, fetch_id: int, result: object) -> None:
        with self._lock:
            on_done = self._waiting.pop(fetch_id, None)
        if on_done is not None:  # exactly once: the pipe's end fails only those still waiting
            _call(on_done, result)


def _call(on_done: Callable[[object], None], result: object) -> None:
    try:
        on_done(result)
    except Exception:  # the connector's callback: its failure must not take the pipe down
        logger.exception("KV relay: a fetch's callback failed")


class KVRelay:
    """The replica's side: runs the core's transport calls on `transport` (a Ray worker's),
    on a thread of its own; a fetch's bytes go back over the pipe from the thread the real
    transport finishes it on. `alive` is False once the pipe ended: the core exited, or the
    pipe broke, after which the core's transfers fail (the replica's health check says so)."""

    def __init__(self, transport: KVTransport, conn: Connection) -> None:
        self.transport = transport
        self._wire = _Wire(conn)
        self._thread = threading.Thread(target=self._serve, name="pdserve-kv-relay", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _serve(self) -> None:
        try:
            while True:
                kind, *args = self._wire.recv()
                if kind == "publish":
                    transfer_id, num_tokens, *header = args
                    try:
                        kv = self._wire.recv_tensor(*header)
                    except MalformedKV as e:
                        kv = e  # garbled on the way from the core: abandoned, never published
                    self._publish(transfer_id, kv, num_tokens)
                elif kind == "fetch":
                    self._fetch(*args)
                elif kind in ("abandon", "release"):
                    try:
                        getattr(self.transport, kind)(*args)
                    except Exception:  # the store's lease ends the transfer anyway
                        logger.exception("KV relay: %s of %s failed", kind, args[0])
                else:
                    raise TypeError(f"unknown message {kind!r}")
        except (EOFError, OSError):
            pass  # the core process ended (or the replica closed the relay)
        except Exception:  # a garbled pipe: the core's side sees it close and fails its fetches
            logger.exception("KV relay failed; the engine core's transfers fail from now on")
        finally:
            self._wire.shutdown()
            self._wire.close()

    def _publish(self, transfer_id: str, kv: torch.Tensor | MalformedKV, num_tokens: int) -> None:
        # As the connector does with a local transport: an export that cannot be handed over
        # is abandoned, so its consumer fails (or recomputes) at once instead of waiting.
        try:
            if isinstance(kv, MalformedKV):
                raise kv
            self.transport.publish(transfer_id, kv, num_tokens)
        except Exception as e:
            logger.warning("KV export %s failed: %s", transfer_id, e)
            try:
                self.transport.abandon(transfer_id, f"KV export failed: {e}")
            except Exception:
                logger.exception("KV relay: abandoning %s failed", transfer_id)

    def _fetch(self, fetch_id: int, params: KVTransferParams) -> None:
        try:
            self.transport.fetch_async(params, lambda result: self._answer(fetch_id, result))
        except Exception as e:
            self._answer(fetch_id, TransferError(f"{type(e).__name__}: {e}"))

    def _answer(self, fetch_id: int, result: object) -> None:
        try:
            if isinstance(result, torch.Tensor):
                self._wire.send_tensor(("fetched", fetch_id), result)
            else:
                self._wire.send("failed", fetch_id, str(result))
        except OSError:
            pass  # the core is gone, and the request with it

    def close(self, timeout_s: float = 5.0) -> None:
        """End the relay (the core then fails any fetch it still waits for); bounded."""
        self._wire.shutdown()
        self._thread.join(timeout_s)


class RelayConnectorFactory:
    """Builds the P/D connector's sides in the engine core process, over one RelayTransport
    (both sides share it: one reader of the pipe). Crosses into the spawned process with the
    core's end of the pipe (`spawn_safe`: engine.core_client.client.CoreProcClient accepts it)."""

    spawn_safe = True

    def __init__(self, conn: Connection, transport_name: str, pd_role: str, replica_id: str, block_size: int,
                 load_failure_policy: str) -> None:
        self.conn = conn
        self.transport_name = transport_name
        self.pd_role = pd_role
        self.replica_id = replica_id
        self.block_size = block_size
        self.load_failure_policy = load_failure_policy
        self._transport: RelayTransport | None = None

    def __call__(self, side):
        if self._transport is None:
            self._transport = RelayTransport(self.conn, self.transport_name)
        return PDConnector(side, self.pd_role, self._transport, self.replica_id, self.block_size,
                           self.load_failure_policy)
