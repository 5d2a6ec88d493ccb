"""The relayed transport (kvstore.transports.relay): an engine core in a child process moves KV
through its replica's transport. Each transport call arrives at the real transport whole; a
fetch's bytes come back exactly; a closed pipe fails what waits on it, never hangs; and two
engines whose cores run in processes of their own do P/D with the prompt KV loaded, not
recomputed, giving Hugging Face's greedy tokens with nothing left behind."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import kvstore.transports.relay as relay_module
from cluster.pd.split import decode_request, prefill_request
from engine import EngineArgs, SamplingParams
from engine.kv_transfer_params import KVTransferParams
from engine.llm_engine import LLMEngine
from kvstore.kv_io import MalformedKV
from kvstore.transports import LocalTransport, TransferError
from kvstore.transports.relay import KVRelay, RelayConnectorFactory, RelayTransport
from tests.engine.hf_reference import hf_greedy, random_prompts
from tests.kvstore.helpers import finish_all

BS = 16
_WAIT_S = 30.0


def _params(tid: str, n: int = 4) -> KVTransferParams:
    return KVTransferParams(transfer_id=tid, num_tokens=n, block_size=BS, transport="local")


@pytest.fixture
def relayed():
    """(RelayTransport, KVRelay, the LocalTransport behind it) over a real pipe."""
    ours, theirs = mp.get_context("spawn").Pipe()
    behind = LocalTransport()
    relay = KVRelay(behind, ours)
    core_side = RelayTransport(theirs, "local")
    yield core_side, relay, behind
    relay.close()  # the core side's reader then closes its own end (it owns it)


def _fetch(transport: RelayTransport, params: KVTransferParams):
    done: queue.Queue = queue.Queue()
    transport.fetch_async(params, done.put)
    return done.get(timeout=_WAIT_S)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_published_export_reaches_the_real_transport_and_fetches_back_bit_for_bit(relayed, dtype):
    core_side, _relay, behind = relayed
    kv = torch.randn(3, 2, 37, 2, 8).to(dtype)
    core_side.publish("t1", kv, 37)
    fetched = _fetch(core_side, _params("t1"))
    assert fetched.dtype == dtype and fetched.shape == kv.shape
    assert torch.equal(fetched.view(torch.uint8), kv.view(torch.uint8))
    assert torch.equal(behind._data["t1"].view(torch.uint8), kv.view(torch.uint8))


def test_a_missing_or_abandoned_transfer_fails_its_fetch_with_the_reason(relayed):
    core_side, _relay, _behind = relayed
    missing = _fetch(core_side, _params("nope"))
    assert isinstance(missing, TransferError) and "'nope' not found" in str(missing)
    core_side.abandon("t2", "KV export failed: out of memory")
    abandoned = _fetch(core_side, _params("t2"))
    assert isinstance(abandoned, TransferError) and "out of memory" in str(abandoned)


def test_a_release_reaches_the_real_transport(relayed):
    core_side, _relay, behind = relayed
    core_side.publish("t3", torch.ones(1, 2, 4, 1, 2), 4)
    assert isinstance(_fetch(core_side, _params("t3")), torch.Tensor)  # the publish has arrived
    core_side.release(_params("t3"))
    # Calls are served in order: a fetch after the release finds nothing.
    assert isinstance(_fetch(core_side, _params("t3")), TransferError)
    assert behind.live_transfers == 0


def _wrong_crc32(kv: torch.Tensor) -> int:
    """A header's crc32 for bytes other than `kv`'s (what a garbled relay would deliver)."""
    return zlib.crc32(kv.contiguous().reshape(-1).view(torch.uint8).numpy()) ^ 1


def test_fetched_bytes_that_do_not_match_their_crc32_are_refused_and_the_pipe_goes_on(relayed, monkeypatch):
    core_side, _relay, behind = relayed
    kv = torch.randn(3, 2, 5, 2, 8)
    behind.publish("t8", kv, 5)
    monkeypatch.setattr(relay_module, "kv_crc32", _wrong_crc32)  # the sender's header only
    refused = _fetch(core_side, _params("t8", 5))
    assert isinstance(refused, MalformedKV) and refused.reason == "bytes" and "crc32" in str(refused)
    monkeypatch.undo()
    assert torch.equal(_fetch(core_side, _params("t8", 5)), kv)  # the pipe is still in step


def test_published_bytes_that_do_not_match_their_crc32_are_abandoned_not_published(relayed, monkeypatch):
    core_side, _relay, behind = relayed
    monkeypatch.setattr(relay_module, "kv_crc32", _wrong_crc32)
    core_side.publish("t9", torch.randn(3, 2, 5, 2, 8), 5)
    monkeypatch.undo()
    abandoned = _fetch(core_side, _params("t9", 5))  # its consumer learns why at once
    assert isinstance(abandoned, TransferError) and "malformed KV (bytes)" in str(abandoned)
    assert behind.live_transfers == 0


def test_an_export_the_real_transport_refuses_is_abandoned_and_a_failing_fetch_is_answered():
    ours, theirs = mp.get_context("spawn").Pipe()

    class Refusing(LocalTransport):
        def publish(self, transfer_id, kv, num_tokens):
            raise MemoryError("object store full")

        def fetch_async(self, params, on_done):
            if params.transfer_id == "broken":
                raise RuntimeError("store handle lost")
            super().fetch_async(params, on_done)

    relay = KVRelay(Refusing(), ours)
    core_side = RelayTransport(theirs, "local")
    core_side.publish("t6", torch.ones(1, 2, 4, 1, 2), 4)
    refused = _fetch(core_side, _params("t6"))  # its consumer learns why at once
    assert isinstance(refused, TransferError) and "KV export failed: object store full" in str(refused)
    broken = _fetch(core_side, _params("broken"))
    assert isinstance(broken, TransferError) and "store handle lost" in str(broken)
    core_side.publish("t7", torch.ones(1, 2, 4, 1, 2), 4)  # the relay still serves
    assert "object store full" in str(_fetch(core_side, _params("t7")))
    relay.close()


def test_a_closed_relay_fails_waiting_and_later_fetches_at_once():
    ours, theirs = mp.get_context("spawn").Pipe()

    class Silent(LocalTransport):
        def fetch_async(self, params, on_done):  # never answers: the fetch waits on the pipe
            pass

    relay = KVRelay(Silent(), ours)
    core_side = RelayTransport(theirs, "local")
    done: queue.Queue = queue.Queue()
    core_side.fetch_async(_params("t4"), done.put)
    relay.close()
    waiting = done.get(timeout=_WAIT_S)
    assert isinstance(waiting, TransferError) and "relay is gone" in str(waiting)
    later = _fetch(core_side, _params("t5"))
    assert isinstance(later, TransferError) and "relay is gone" in str(later)
    core_side.release(_params("t5"))  # fire and forget: no error once the replica is gone


def test_concurrent_transfers_each_get_their_own_bytes():
    """Exports from several threads, and fetches answered from several threads at once (as
    the object store's fetch threads do), never interleave on the pipe."""
    ours, theirs = mp.get_context("spawn").Pipe()

    class Threaded(LocalTransport):
        def fetch_async(self, params, on_done):
            threading.Thread(target=super().fetch_async, args=(params, on_done)).start()

    behind = Threaded()
    relay = KVRelay(behind, ours)
    core_side = RelayTransport(theirs, "local")
    kvs = {f"c{i}": torch.full((2, 2, 300 + i, 2, 16), float(i)) for i in range(24)}  # ~150 KB each
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda item: core_side.publish(item[0], item[1], item[1].shape[2]), kvs.items()))
        fetched = dict(zip(kvs, pool.map(lambda tid: _fetch(core_side, _params(tid)), kvs)))
    for tid, kv in kvs.items():
        assert isinstance(fetched[tid], torch.Tensor) and torch.equal(fetched[tid], kv), tid
    relay.close()


def test_a_broken_pipe_fails_exports_and_lets_abandons_and_releases_pass():
    ours, theirs = mp.get_context("spawn").Pipe()
    relay = KVRelay(LocalTransport(), ours)
    core_side = RelayTransport(theirs, "local")
    relay.close()
    assert not relay.alive
    assert isinstance(_fetch(core_side, _params("t8")), TransferError)  # once the core side saw it
    with pytest.raises(TransferError, match="relay is gone"):
        core_side.publish("t8", torch.ones(1, 2, 4, 1, 2), 4)  # the connector then abandons it
    core_side.abandon("t8", "KV export failed")  # no error: nobody is left to tell
    core_side.release(_params("t8"))


# ---- two engines, each core in a child process ---------------------------------------------
class _Registry(LocalTransport):
    """A LocalTransport whose lookups wait (bounded) for a transfer still on its way, as the KV
    store's do: a relayed export reaches it over its own pipe, after or before the prefill's
    output reaches the engine's front end."""

    def __init__(self) -> None:
        super().__init__()
        self._published = threading.Condition()

    def publish(self, transfer_id, kv, num_tokens):
        with self._published:
            super().publish(transfer_id, kv, num_tokens)
            self._published.notify_all()

    def fetch_async(self, params, on_done):
        with self._published:
            self._published.wait_for(lambda: params.transfer_id in self._data, timeout=_WAIT_S)
        super().fetch_async(params, on_done)


def _engine(model: str, pd_role: str, behind: LocalTransport):
    config = EngineArgs(model=model, max_model_len=256, block_size=BS, engine_core_process=True,
                        max_num_batched_tokens=64, long_prefill_token_threshold=32).create_engine_config()
    ours, theirs = mp.get_context("spawn").Pipe()
    relay = KVRelay(behind, ours)
    factory = RelayConnectorFactory(theirs, behind.name, pd_role, f"{pd_role}-0", BS, "fail")
    engine = LLMEngine(config, factory)
    theirs.close()  # the core holds its own end
    return engine, relay



def test_pd_across_two_core_processes_loads_the_prompt_kv_and_matches_transformers(tiny_model):
    behind = _Registry()
    prefill, _p_relay = _engine(tiny_model, "producer", behind)
    decode, d_relay = _engine(tiny_model, "consumer", behind)
    try:
        prompts = random_prompts([9, 40, 23, 61, 17, 33], 250, seed=5)
        greedy = SamplingParams(temperature=0.0, max_tokens=12)
        expected = hf_greedy(tiny_model, prompts, 12)
        rids = {f"r{i}" for i in range(len(prompts))}
        requests = [prefill.process({"prompt_token_ids": prompt}, greedy, f"r{i}") for i, prompt in enumerate(prompts)]
        for req in requests:  # all at once: exports and loads cross together
            prefill.add(prefill_request(req))
        firsts = finish_all(prefill, rids)
        for i in range(len(prompts)):
            first = firsts[f"r{i}"]
            assert first.kv_transfer_params is not None and first.kv_transfer_params.transport == "local"
            decode.add(decode_request(requests[i], first))
        lasts = finish_all(decode, rids)
        for i in range(len(prompts)):
            first, last = firsts[f"r{i}"].outputs[0], lasts[f"r{i}"].outputs[0]
            assert last.finish_reason == "length", last.stop_reason
            assert [first.token_ids[0], *last.token_ids] == expected[i]
        stats = decode.core.kv_transfer_stats()
        assert stats["loads"] == len(prompts) and stats["load_failures"] == 0
        assert prefill.core.kv_transfer_stats()["exports"] == len(prompts)
        for engine in (prefill, decode):
            figures = engine.core.load()
            assert figures.free_blocks == figures.total_blocks
        assert behind.live_transfers == 0  # every transfer released by the decode side
        # A core that dies ends its relay (its replica's health check reads `alive`): the front
        # end closed its copy of the core's end, so the pipe closes with the core.
        [pid] = decode.core.core_pids()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + _WAIT_S
        while d_relay.alive and time.monotonic() < deadline:
            d_relay._thread.join(0.1)
        assert not d_relay.alive
    finally:
        prefill.core.shutdown()
        decode.core.shutdown()
