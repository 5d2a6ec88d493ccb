"""KV handed back in the prefill's reply (kvstore.handoff): an export the producer expects back
never reaches the store, and neither does the consumer's fetch or release of one delivered to
its inbox; an export that comes too late, or one nobody expects, goes to the store as before;
an export that failed reaches the consumer as its reason. Two engines whose cores run in child
processes (the prefill's export crossing its relay thread, which may run behind its output) do
P/D this way with Hugging Face's greedy tokens, the prompt KV loaded, and no call to the store.
Oracles: a recording stand-in for the store actor, the tensors themselves, transformers."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import threading
import time
import zlib
from types import SimpleNamespace

import pytest
import ray
import torch

from cluster.pd.split import decode_request, prefill_request
from engine import EngineArgs, SamplingParams
from engine.kv_transfer_params import KVTransferParams
from engine.llm_engine import LLMEngine
from kvstore.handoff import (
    DECLINED,
    GRPC_MAX_MESSAGE,
    ExportFailed,
    Handbacks,
    Inbox,
    KVHandoff,
    max_reply_kv_bytes,
)
from kvstore.kv_io import MalformedKV
from kvstore.transports import TransferError
from kvstore.transports.object_store import ObjectStoreTransport
from kvstore.transports.relay import KVRelay, RelayConnectorFactory
from tests.engine.hf_reference import hf_greedy, random_prompts
from tests.kvstore.helpers import RecordingStore as _Store
from tests.kvstore.helpers import finish_all

BS = 16
_WAIT_S = 30.0


def _transport(store: _Store) -> ObjectStoreTransport:
    # With a handle of its own the producer holds exports for the store to pull (no ray.put).
    transport = ObjectStoreTransport(store, "replica-0", lambda: "producer-handle", fetch_timeout_s=5.0)
    transport.max_reply_bytes = 64 * 1024 * 1024  # not this process's environment's
    return transport


def _params(tid: str) -> KVTransferParams:
    return KVTransferParams(transfer_id=tid, num_tokens=4, block_size=BS, transport="object_store")


def _fetch_now(transport, tid: str):
    got: list = []
    transport.fetch_async(_params(tid), got.append)
    assert len(got) == 1, "a handed-off fetch is answered at once, on the caller's thread"
    return got[0]


def test_an_expected_export_is_kept_for_the_reply_and_never_registered():
    store = _Store()
    producer = _transport(store)
    kv = torch.randn(2, 2, 4, 1, 8)
    producer.handbacks.expect("t1")
    producer.publish("t1", kv, 4)
    assert store.calls == [] and producer.outbox_size == 0
    assert len(producer.handbacks) == 1
    assert torch.equal(producer.handbacks.poll("t1"), kv)
    assert len(producer.handbacks) == 0 and producer.handbacks.take("t1") is None
    # Not expected (any more): registered with the store as before.
    producer.publish("t1", kv, 4)
    assert store.names() == ["register"] and producer.outbox_size == 1


def test_a_failed_expected_export_goes_back_as_its_reason_not_to_the_store():
    store = _Store()
    producer = _transport(store)
    producer.handbacks.expect("t2")
    producer.abandon("t2", "KV export failed: out of memory")
    assert store.calls == []
    assert producer.handbacks.take("t2") == ExportFailed("KV export failed: out of memory")
    producer.abandon("t3", "KV export failed: nobody expects this one")
    assert store.names() == ["abandon"]


def test_an_export_too_big_for_a_reply_goes_to_the_store_and_the_reply_says_so_at_once():
    store = _Store()
    producer = _transport(store)
    producer.max_reply_bytes = 1000
    producer.handbacks.expect("big")
    producer.publish("big", torch.zeros(251), 251)  # 1004 bytes
    assert store.names() == ["register"] and producer.outbox_size == 1
    assert producer.handbacks.poll("big") is DECLINED  # no wait for an export that went elsewhere
    producer.handbacks.expect("small")
    producer.publish("small", torch.zeros(250), 250)
    assert store.names() == ["register"] and producer.handbacks.poll("small").numel() == 250


def test_the_requesters_bound_declines_an_export_its_channel_would_refuse():
    # The prefill side allows 64 MiB, but the ingress that asked (another node, other
    # settings) takes only 1,000 bytes of KV: the smaller bound decides.
    store = _Store()
    producer = _transport(store)
    producer.handbacks.expect("big", max_bytes=1000)
    producer.publish("big", torch.zeros(251), 251)  # 1004 bytes
    assert store.names() == ["register"] and producer.handbacks.poll("big") is DECLINED
    producer.handbacks.expect("fits", max_bytes=1000)
    producer.publish("fits", torch.zeros(250), 250)
    assert store.names() == ["register"] and producer.handbacks.poll("fits").numel() == 250
    # The bound goes with the id: expected again without one, the same export fits (also when
    # nothing took the bounded expectation in between).
    producer.handbacks.expect("big", max_bytes=1000)
    producer.handbacks.expect("big")
    producer.publish("big", torch.zeros(251), 251)
    assert store.names() == ["register"] and producer.handbacks.poll("big").numel() == 251


def test_a_reply_carries_at_most_the_grpc_limit_less_room_for_the_output():
    mib = 1024 * 1024
    assert max_reply_kv_bytes({}) == 3 * mib  # Serve's own 4 MiB
    assert max_reply_kv_bytes({GRPC_MAX_MESSAGE: str(128 * mib)}) == 127 * mib
    assert max_reply_kv_bytes({GRPC_MAX_MESSAGE: "1000"}) == 0


def test_take_waits_for_an_export_still_on_its_way_and_gives_up_after_its_bound():
    handbacks = Handbacks()
    handbacks.expect("late")
    assert handbacks.poll("late") is None  # not here yet: still expected
    kv = torch.ones(3)
    threading.Timer(0.05, handbacks.offer, ("late", kv)).start()
    assert torch.equal(handbacks.take("late", timeout_s=_WAIT_S), kv)
    handbacks.expect("never")
    start = time.monotonic()
    assert handbacks.take("never", timeout_s=0.2) is None
    assert time.monotonic() - start >= 0.2
    assert not handbacks.offer("never", kv), "after take the export goes to the store"


def test_giving_up_on_an_export_releases_a_thread_still_waiting_for_it():
    # A cancelled prefill's cleanup takes the id while its wait still runs on an executor
    # thread: that thread must not sleep out its bound.
    handbacks = Handbacks()
    handbacks.expect("cancelled")
    waited: queue.Queue = queue.Queue()
    waiter = threading.Thread(target=lambda: waited.put(handbacks.take("cancelled", timeout_s=_WAIT_S)))
    waiter.start()
    deadline = time.monotonic() + _WAIT_S
    while not handbacks._expected["cancelled"]._cond._waiters:  # until it waits (bounded)
        assert time.monotonic() < deadline, "the waiter never waited"
        time.sleep(0.001)
    start = time.monotonic()
    assert handbacks.take("cancelled") is None
    waiter.join(_WAIT_S)
    assert not waiter.is_alive() and waited.get_nowait() is None
    assert time.monotonic() - start < 5.0, "the waiter slept out its bound"


def test_a_delivered_transfer_is_fetched_and_released_without_the_store():
    store = _Store()
    consumer = _transport(store)
    kv = torch.randn(2, 2, 4, 1, 8)
    consumer.inbox.deliver("t4", kv)
    assert _fetch_now(consumer, "t4") is kv
    assert len(consumer.inbox) == 1  # fetched, its release still to come
    consumer.release(_params("t4"))
    assert store.calls == [] and len(consumer.inbox) == 0
    consumer.inbox.deliver("t5", ExportFailed("KV export failed: disk on fire"))
    failed = _fetch_now(consumer, "t5")
    assert isinstance(failed, TransferError) and "disk on fire" in str(failed)
    consumer.release(_params("t5"))
    # Delivered, then released before any fetch (aborted, or the prefix cache covered it).
    consumer.inbox.deliver("t6", kv)
    consumer.release(_params("t6"))
    assert store.calls == [] and len(consumer.inbox) == 0
    # Never delivered here: a store transfer, released there.
    consumer.release(_params("t7"))
    assert store.names() == ["release"]


def test_an_undelivered_transfer_is_looked_up_in_the_store():
    store = _Store()
    consumer = _transport(store)
    done: queue.Queue = queue.Queue()
    consumer.fetch_async(_params("elsewhere"), done.put)
    failed = done.get(timeout=_WAIT_S)
    assert isinstance(failed, TransferError) and "answers no lookup" in str(failed)
    assert store.names() == ["lookup"]


def test_the_inbox_drops_what_outlived_its_ttl_at_the_next_delivery():
    now = [0.0]
    inbox = Inbox(ttl_s=10.0, clock=lambda: now[0])
    inbox.deliver("old", torch.ones(1))
    inbox.deliver("fetched", torch.ones(1))
    assert inbox.claim("fetched") is not None
    now[0] = 9.0
    inbox.deliver("new", torch.ones(1))
    assert len(inbox) == 3
    now[0] = 10.5
    inbox.deliver("newer", torch.ones(1))
    assert len(inbox) == 2 and inbox.claim("old") is None
    assert not inbox.forget("fetched") and inbox.forget("new") and inbox.forget("newer")
    assert len(inbox) == 0


def test_counting_the_inbox_drops_what_outlived_its_ttl_without_a_delivery():
    # Traffic stopped: the replica's load reports count the inbox, and that sweeps it.
    now = [0.0]
    inbox = Inbox(ttl_s=10.0, clock=lambda: now[0])
    inbox.deliver("left", torch.ones(1))
    inbox.deliver("loading", torch.ones(1))
    inbox.claim("loading")
    assert len(inbox) == 2
    now[0] = 10.0
    assert len(inbox) == 0 and inbox.claim("left") is None and not inbox.forget("loading")
    # Taken entries expire by their own deadlines, not in the order they were claimed.
    inbox.deliver("early", torch.ones(1))
    now[0] = 15.0
    inbox.deliver("late", torch.ones(1))
    inbox.claim("late")
    inbox.claim("early")  # claimed last, expires first (at 20)
    now[0] = 21.0
    assert len(inbox) == 1 and not inbox.forget("early") and inbox.forget("late")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_handoff_pickles_its_kv_bit_for_bit_as_one_out_of_band_buffer(dtype):
    kv = torch.randn(4, 2, 37, 2, 8).to(dtype)
    handoff = KVHandoff(None, kv=kv)
    buffers: list = []
    data = pickle.dumps(handoff, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and len(data) < 1024  # the bytes travel beside the stream
    back = pickle.loads(data, buffers=buffers)
    assert back.kv.dtype == dtype and back.kv.shape == kv.shape
    assert torch.equal(back.kv.view(torch.uint8), kv.view(torch.uint8))
    # As Ray may hand them over: a read-only buffer is copied, never written through.
    frozen = [memoryview(bytes(b.raw())) for b in buffers]
    assert torch.equal(pickle.loads(data, buffers=frozen).kv.view(torch.uint8), kv.view(torch.uint8))
    # In band, as Serve's gRPC path pickles (cloudpickle with no buffer callback).
    assert torch.equal(pickle.loads(pickle.dumps(handoff, protocol=5)).kv.view(torch.uint8), kv.view(torch.uint8))
    failed = pickle.loads(pickle.dumps(KVHandoff(None, error="why"), protocol=5))
    assert failed.kv is None and failed.error == "why"


def test_a_reply_whose_kv_bytes_changed_on_the_way_is_refused_not_unpickled_as_kv():
    kv = torch.randn(4, 2, 37, 2, 8)
    buffers: list = []
    data = pickle.dumps(KVHandoff(None, kv=kv), protocol=5, buffer_callback=buffers.append)
    garbled = bytearray(buffers[0].raw())
    garbled[100] ^= 0x80
    refused = pickle.loads(data, buffers=[garbled])
    assert refused.kv is None and refused.handed_off and refused.refused == "bytes"
    assert isinstance(refused.value, MalformedKV) and "crc32" in str(refused.value)
    rebuild, (output, raw, dtype, _shape, error, crc32) = KVHandoff(None, kv=kv).__reduce__()
    other_shape = rebuild(output, raw, dtype, (4, 2, 36, 2, 8), error, crc32)  # a header its bytes do not fill
    assert other_shape.refused == "bytes" and "needs" in other_shape.error
    # The requester's fetch hands the refusal to its connector (which counts it), not a tensor.
    consumer = _transport(_Store())
    consumer.inbox.deliver("t1", refused.value)
    assert isinstance(_fetch_now(consumer, "t1"), MalformedKV)


def test_an_export_registered_in_the_store_carries_its_crc32_and_a_fetch_refuses_other_bytes(monkeypatch):
    store = _Store()
    producer = _transport(store)
    kv = torch.randn(2, 2, 4, 1, 8)
    producer.publish("t1", kv, 4)  # not expected back: registered with the store
    meta = store.keywords[0]["meta"]
    assert meta["crc32"] == zlib.crc32(kv.numpy().tobytes())
    held = producer.take_export("t1")
    garbled = held.clone()
    garbled.view(-1)[3] += 1.0
    # No Ray here: a lookup answers its entry itself, and ray.get hands back what it is given.
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    for refs, refused in (([held], False), ([garbled], True), ([held[:, :, :3]], True)):  # fewer bytes
        entry = {"refs": refs, "nbytes": kv.numel() * kv.element_size(), "num_tokens": 4, "meta": meta}
        consumer = _transport(SimpleNamespace(lookup=SimpleNamespace(remote=lambda tid, wait_s=0.0, e=entry: e)))
        done: queue.Queue = queue.Queue()
        consumer.fetch_async(_params("t1"), done.put)  # on the transport's fetch thread
        result = done.get(timeout=_WAIT_S)
        if refused:
            assert isinstance(result, MalformedKV) and result.reason == "bytes", result
        else:
            assert torch.equal(result, kv)


def test_a_handoff_says_whether_it_carries_the_kv():
    assert not KVHandoff(None).handed_off
    assert KVHandoff(None, error="why").value == ExportFailed("why")
    kv = torch.zeros(1)
    assert KVHandoff(None, kv=kv).handed_off and KVHandoff(None, kv=kv).value is kv


# ---- two engines, each core in a child process, the KV in the "reply" -----------------------
def _engine(model: str, pd_role: str, transport: ObjectStoreTransport):
    config = EngineArgs(model=model, max_model_len=256, block_size=BS, engine_core_process=True,
                        max_num_batched_tokens=64, long_prefill_token_threshold=32).create_engine_config()
    ours, theirs = mp.get_context("spawn").Pipe()
    relay = KVRelay(transport, ours)
    engine = LLMEngine(config, RelayConnectorFactory(theirs, transport.name, pd_role, f"{pd_role}-0", BS, "fail"))
    theirs.close()  # the core holds its own end
    return engine, relay



@pytest.mark.parametrize("policy_fail", [False, True])
def test_pd_across_core_processes_with_the_kv_in_the_reply_matches_transformers(tiny_model, policy_fail):
    store = _Store()
    producer, consumer = _transport(store), _transport(store)
    prefill, _ = _engine(tiny_model, "producer", producer)
    decode, _ = _engine(tiny_model, "consumer", consumer)
    try:
        prompts = random_prompts([9, 40, 23, 61, 17], 250, seed=7)
        greedy = SamplingParams(temperature=0.0, max_tokens=8)
        expected = hf_greedy(tiny_model, prompts, 8)
        rids = {f"r{i}" for i in range(len(prompts))}
        requests = [prefill.process({"prompt_token_ids": prompt}, greedy, f"r{i}") for i, prompt in enumerate(prompts)]
        for i, req in enumerate(requests):
            producer.handbacks.expect(f"t{i}")
            prefill.add(prefill_request(req, f"t{i}"))
        firsts = finish_all(prefill, rids)
        for i in range(len(prompts)):
            first = firsts[f"r{i}"]
            assert first.kv_transfer_params.transfer_id == f"t{i}"
            kv = producer.handbacks.take(f"t{i}", timeout_s=_WAIT_S)  # may still cross the relay
            assert isinstance(kv, torch.Tensor)
            # The last prompt's export "failed": its decode fails with the reason, never runs.
            consumer.inbox.deliver(f"t{i}", ExportFailed("KV export failed: test") if policy_fail and i == 4 else kv)
            decode.add(decode_request(requests[i], first))
        lasts = finish_all(decode, rids)
        for i in range(len(prompts)):
            first, last = firsts[f"r{i}"].outputs[0], lasts[f"r{i}"].outputs[0]
            if policy_fail and i == 4:
                assert last.finish_reason == "error" and "KV export failed: test" in last.stop_reason
                continue
            assert last.finish_reason == "length", last.stop_reason
            assert [first.token_ids[0], *last.token_ids] == expected[i]
        stats = decode.core.kv_transfer_stats()
        assert stats["loads"] == len(prompts) - policy_fail and stats["load_failures"] == policy_fail
        assert store.calls == [], "nothing went through the store"
        assert len(producer.handbacks) == 0 and producer.outbox_size == 0
        # Every delivered transfer was released by the decode side's connector (through its relay).
        deadline = time.monotonic() + _WAIT_S
        while len(consumer.inbox) and time.monotonic() < deadline:
            time.sleep(0.01)  # the relay thread runs the releases: bounded poll on its result
        assert len(consumer.inbox) == 0
        for engine in (prefill, decode):
            figures = engine.core.load()
            assert figures.free_blocks == figures.total_blocks
    finally:
        prefill.core.shutdown()
        decode.core.shutdown()
