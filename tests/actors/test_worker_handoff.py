"""EngineHost.prefill_handoff (kvstore.handoff) on a stand-in engine that exports the
prompt KV the way a real one does (in process before its output, or late through a core
process's relay), with a transport whose store records every call: what the reply carries,
what goes to the store instead, and that no expectation outlives the call."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

import cluster.replica.host as worker_module
from cluster.pd.split import prefill_request
from cluster.replica.host import EngineHost
from engine.engine_request import EngineRequest
from engine.kv_transfer_params import KVTransferParams
from engine.sampling_params import SamplingParams
from kvstore.transports.object_store import ObjectStoreTransport
from tests.kvstore.helpers import RecordingStore

KV = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)  # 96 bytes


class _Engine:
    """Runs `export(transfer_id)` where the engine's connector would publish (or abandon) the
    prompt KV, then yields the prefill's one output; `hold` keeps it from finishing."""

    def __init__(self, export, hold: asyncio.Event | None = None) -> None:
        self.export, self.hold = export, hold
        self.entered = asyncio.Event()

    async def generate(self, request):
        assert request.sampling_params.max_tokens == 1 and request.kv_transfer_params.do_remote_decode
        self.entered.set()
        if self.hold is not None:
            await self.hold.wait()
        tid = request.kv_transfer_params.transfer_id
        self.export(tid)
        yield SimpleNamespace(request_id=request.request_id, kv_transfer_params=KVTransferParams(transfer_id=tid))


def _worker(export, hold=None, transport=True) -> tuple[EngineHost, RecordingStore]:
    store = RecordingStore()
    worker = object.__new__(EngineHost)
    worker.engine, worker.replica_id, worker.role = _Engine(export, hold), "prefill-x", "prefill"
    worker.relay = None
    worker.transport = None
    if transport:
        worker.transport = ObjectStoreTransport(store, "prefill-x", lambda: "producer-handle", fetch_timeout_s=5.0)
        worker.transport.max_reply_bytes = 64 * 1024 * 1024  # not this process's environment's
    return worker, store


def _prefill_half(request_id: str, ids: list[int], tid: str) -> EngineRequest:
    """The prefill half (exported as `tid`) of a request as an ingress builds it."""
    return prefill_request(EngineRequest(request_id, ids, SamplingParams(max_tokens=8)), tid)


def _handoff(worker, tid: str, max_kv_bytes=None):
    return asyncio.run(worker.prefill_handoff(_prefill_half(f"req-{tid}", [1, 2, 3], tid), max_kv_bytes))


def test_the_kv_exported_in_process_comes_back_in_the_reply_and_never_reaches_the_store():
    worker, store = _worker(lambda tid: worker.transport.publish(tid, KV, 3))
    reply = _handoff(worker, "t1")
    assert reply.handed_off and torch.equal(reply.kv, KV) and reply.error is None
    assert store.calls == [] and len(worker.transport.handbacks) == 0


def test_a_failed_export_comes_back_as_its_reason():
    worker, store = _worker(lambda tid: worker.transport.abandon(tid, "KV export failed: no blocks"))
    reply = _handoff(worker, "t2")
    assert reply.kv is None and reply.error == "KV export failed: no blocks"
    assert store.calls == []


def test_a_kv_over_the_requesters_bound_goes_to_the_store_and_the_reply_says_so_at_once():
    worker, store = _worker(lambda tid: worker.transport.publish(tid, KV, 3))
    reply = _handoff(worker, "t3", max_kv_bytes=95)
    assert not reply.handed_off and reply.output.request_id == "req-t3"
    assert store.names() == ["register"] and worker.transport.outbox_size == 1
    assert len(worker.transport.handbacks) == 0


def test_an_export_still_crossing_the_relay_is_waited_for():
    # A core in a child process: the export reaches the replica after the output.
    def late(tid):
        threading.Timer(0.2, worker.transport.publish, (tid, KV, 3)).start()

    worker, store = _worker(late)
    reply = _handoff(worker, "t4")
    assert torch.equal(reply.kv, KV) and store.calls == []


def test_an_export_later_than_the_bound_goes_to_the_store(monkeypatch):
    monkeypatch.setattr(worker_module, "_HANDBACK_WAIT_S", 0.05)
    done = threading.Event()

    def very_late(tid):
        def publish():
            worker.transport.publish(tid, KV, 3)
            done.set()
        threading.Timer(0.5, publish).start()

    worker, store = _worker(very_late)
    reply = _handoff(worker, "t5")
    assert not reply.handed_off  # "not handed off": the decode side looks it up in the store
    assert done.wait(10.0)
    assert store.names() == ["register"] and len(worker.transport.handbacks) == 0


def test_without_a_one_rank_transport_the_reply_carries_no_kv():
    # Tensor or data parallel: the ranks export shards to the store as usual.
    worker, _store = _worker(lambda tid: None, transport=False)
    reply = _handoff(worker, "t6")
    assert not reply.handed_off and reply.output.request_id == "req-t6"


def test_a_cancelled_prefill_leaves_no_expectation_and_its_export_goes_to_the_store():
    hold = asyncio.Event()
    worker, store = _worker(lambda tid: worker.transport.publish(tid, KV, 3), hold=hold)

    async def main():
        task = asyncio.create_task(worker.prefill_handoff(_prefill_half("req-t7", [1], "t7")))
        await asyncio.wait_for(worker.engine.entered.wait(), 10.0)  # expecting its export by now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert len(worker.transport.handbacks) == 0
    worker.transport.publish("t7", KV, 3)  # an export that still came (the engine was ahead)
    assert store.names() == ["register"]
