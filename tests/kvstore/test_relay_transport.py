"""The relayed transport (kvstore.transports.relay): an engine core in a child process moves KV
through its replica's transport. Each transport call arrives at the real transport whole; a
fetch's bytes come back exactly; a closed pipe fails what waits on it, never hangs; and two
engines whose cores run in processes of their own do P/D with the prompt KV loaded, not
recomputed, giving Hugging Face's greedy tokens with nothing left behind."""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading

import pytest
import torch

from engine import EngineArgs, SamplingParams
from engine.kv_transfer_params import KVTransferParams
from engine.llm_engine import LLMEngine
from kvstore.pd import (
    decode_kv_params,
    decode_params,
    decode_prompt,
    prefill_kv_params,
    prefill_params,
)
from kvstore.transports import LocalTransport, TransferError
from kvstore.transports.relay import KVRelay, RelayConnectorFactory, RelayTransport
from tests.engine.hf_reference import hf_greedy, random_prompts

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
    theirs.close()
    relay.close()


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
    theirs.close()
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
    theirs.close()


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


def _run(engine, rid):
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def test_pd_across_two_core_processes_loads_the_prompt_kv_and_matches_transformers(tiny_model):
    behind = _Registry()
    prefill, _p_relay = _engine(tiny_model, "producer", behind)
    decode, _d_relay = _engine(tiny_model, "consumer", behind)
    try:
        prompts = random_prompts([9, 40, 23], 250, seed=5)
        greedy = SamplingParams(temperature=0.0, max_tokens=12)
        expected = hf_greedy(tiny_model, prompts, 12)
        for i, prompt in enumerate(prompts):
            rid = f"r{i}"
            prefill.add_request(rid, {"prompt_token_ids": prompt}, prefill_params(greedy),
                                kv_transfer_params=prefill_kv_params(greedy))
            first = _run(prefill, rid)
            token = first.outputs[0].token_ids[0]
            assert first.kv_transfer_params is not None and first.kv_transfer_params.transport == "local"
            decode.add_request(rid, decode_prompt(prompt, token), decode_params(greedy),
                               kv_transfer_params=decode_kv_params(first.kv_transfer_params))
            last = _run(decode, rid)
            assert last.outputs[0].finish_reason == "length", last.outputs[0].stop_reason
            assert [token, *last.outputs[0].token_ids] == expected[i]
        stats = decode.core.kv_transfer_stats()
        assert stats["loads"] == len(prompts) and stats["load_failures"] == 0
        assert prefill.core.kv_transfer_stats()["exports"] == len(prompts)
        for engine in (prefill, decode):
            figures = engine.core.load()
            assert figures["free_blocks"] == figures["total_blocks"]
        assert behind.live_transfers == 0  # every transfer released by the decode side
    finally:
        prefill.core.shutdown()
        decode.core.shutdown()

