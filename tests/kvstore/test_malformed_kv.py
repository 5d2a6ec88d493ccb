"""Malformed KV injected at the decode side's connector, on the path a prompt's KV takes by
default (kvstore.handoff: back in the prefill's reply, pickled, into the consumer's inbox):
truncated, another layer count, another dtype, laid out in blocks, other heads, bytes that do
not match their meta. Each is refused before anything is written into the cache (never cast),
counted by reason, logged once, and handled by kv_load_failure_policy: "fail" ends the request
with an error naming the reason, "recompute" gives transformers' greedy tokens. No block,
transfer or handoff is left; with "fail" the ingress answers 503 with Retry-After. Oracles:
transformers, the cache's own bytes."""

from __future__ import annotations

import asyncio
import logging
import pickle

import pytest
import torch

import kvstore.connector as connector_module
from cluster.http.errors import replica_error
from cluster.pd.flow import pd_flow
from cluster.pd.split import decode_request, prefill_request
from cluster.replica.errors import ReplicaError
from engine import EngineArgs, SamplingParams
from engine.llm_engine import LLMEngine
from kvstore.connector import PDConnector
from kvstore.handoff import KVHandoff
from kvstore.kv_io import REFUSAL_REASONS, refusal_key
from kvstore.transports.object_store import ObjectStoreTransport
from tests.engine.hf_reference import hf_greedy, random_prompts
from tests.kvstore.helpers import RecordingStore

BS = 16
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT_LEN = 37  # not a whole number of blocks: a layout of blocks pads it


def _blocks_of(kv: torch.Tensor, size: int) -> torch.Tensor:
    """The transfer as a producer's paged layout [layers, 2, blocks, size, Hkv, D]."""
    pad = -kv.shape[2] % size
    padded = torch.cat([kv, kv.new_zeros(*kv.shape[:2], pad, *kv.shape[3:])], dim=2)
    return padded.reshape(*kv.shape[:2], -1, size, *kv.shape[3:])


def _garbled_reply(kv: torch.Tensor):
    """What the requester unpickles from a reply whose KV bytes changed on the way (one bit)."""
    buffers: list = []
    data = pickle.dumps(KVHandoff(None, kv=kv), protocol=5, buffer_callback=buffers.append)
    raw = bytearray(buffers[0].raw())
    raw[len(raw) // 2] ^= 0x01
    return pickle.loads(data, buffers=[raw]).value


def _reply(kv: torch.Tensor):
    """What the requester unpickles from an intact reply carrying `kv`."""
    buffers: list = []
    data = pickle.dumps(KVHandoff(None, kv=kv), protocol=5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=buffers).value


# reason -> what reaches the consumer's inbox instead of the export `kv` [layers, 2, T, Hkv, D]
MALFORMED = {
    "tokens": lambda kv: _reply(kv[:, :, :-1]),  # truncated: one token short of the params
    "layers": lambda kv: _reply(kv[:-1]),
    "block_size": lambda kv: _reply(_blocks_of(kv, BS // 2)),
    "shape": lambda kv: _reply(kv[..., :-1]),  # another head size
    "dtype": lambda kv: _reply(kv.to(torch.bfloat16)),
    "bytes": _garbled_reply,
}


def test_every_refusal_reason_is_injected_here():
    assert set(MALFORMED) == set(REFUSAL_REASONS)


def _transport(store) -> ObjectStoreTransport:
    transport = ObjectStoreTransport(store, "replica-0", lambda: "producer-handle", fetch_timeout_s=5.0)
    transport.max_reply_bytes = 64 * 1024 * 1024  # not this process's environment's
    return transport


def _engine(model, pd_role, transport, policy):
    config = EngineArgs(model=model, max_model_len=256, block_size=BS).create_engine_config()
    return LLMEngine(config, lambda side: PDConnector(side, pd_role, transport, f"{pd_role}-0", BS, policy))


def _run(engine, rid):
    while True:  # bounded by the engine: a request waiting for KV that never comes would fail the load
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


@pytest.fixture(scope="module", params=["fail", "recompute"])
def pair(request, tiny_model):
    """(policy, prefill engine, decode engine, producer transport, consumer transport, store),
    both transports handing the KV back in the reply; each test leaves them clean."""
    store = RecordingStore()
    producer, consumer = _transport(store), _transport(store)
    prefill = _engine(tiny_model, "producer", producer, request.param)
    decode = _engine(tiny_model, "consumer", consumer, request.param)
    return request.param, prefill, decode, producer, consumer, store


@pytest.fixture(scope="module")
def prompts(tiny_model):
    """One prompt per reason (distinct: a recomputed prompt is in the decode's prefix cache after),
    and transformers' greedy tokens for each."""
    chosen = dict(zip(MALFORMED, random_prompts([PROMPT_LEN] * len(MALFORMED), 1000, seed=47)))
    greedy = hf_greedy(tiny_model, list(chosen.values()), PARAMS.max_tokens)
    return {reason: (prompt, greedy[i]) for i, (reason, prompt) in enumerate(chosen.items())}


@pytest.mark.parametrize("reason", list(MALFORMED))
def test_malformed_kv_is_refused_counted_and_handled_by_the_policy(pair, prompts, reason, monkeypatch, caplog):
    policy, prefill, decode, producer, consumer, store = pair
    prompt, expected = prompts[reason]
    rid = f"{policy}-{reason}"
    worker = decode.core.executor.worker.kv_connector
    before = dict(worker.stats)
    written = []  # block ids of every scatter that wrote into the cache (returned, not raised)
    scatter = connector_module.scatter_kv

    def spy(kv_caches, block_ids, *args, **kwargs):
        scatter(kv_caches, block_ids, *args, **kwargs)
        written.append(block_ids)

    monkeypatch.setattr(connector_module, "scatter_kv", spy)

    producer.handbacks.expect(rid)
    req = prefill.process({"prompt_token_ids": prompt}, PARAMS, rid)
    prefill.add(prefill_request(req, rid))
    first = _run(prefill, rid)
    kv = producer.handbacks.take(rid)
    assert isinstance(kv, torch.Tensor) and kv.shape[2] == PROMPT_LEN
    consumer.inbox.deliver(rid, MALFORMED[reason](kv))
    cache_before = [(k.clone(), v.clone()) for k, v in worker._kv_caches]
    decode.add(decode_request(req, first))
    with caplog.at_level(logging.WARNING, logger="kvstore.connector"):
        last = _run(decode, rid).outputs[0]

    assert written == [], "malformed KV was written into the cache"
    after = worker.stats
    assert after[refusal_key(reason)] == before[refusal_key(reason)] + 1
    assert after["load_failures"] == before["load_failures"] + 1 and after["loads"] == before["loads"]
    assert len([r for r in caplog.records if rid in r.getMessage()]) == 1, "each refusal is logged once"
    if policy == "fail":
        assert last.finish_reason == "error" and last.token_ids == []
        assert f"malformed KV ({reason})" in last.stop_reason
        # Nothing ran for the request: the decode side's cache is what it was, byte for byte.
        assert all(torch.equal(k, k0) and torch.equal(v, v0)
                   for (k, v), (k0, v0) in zip(worker._kv_caches, cache_before, strict=True))
    else:
        assert last.finish_reason == "length", last.stop_reason
        assert [first.outputs[0].token_ids[0], *last.token_ids] == expected
    kv_manager = decode.core.kv_cache_manager
    assert kv_manager.get_num_free_blocks() == kv_manager.num_blocks and not decode.has_unfinished_requests()
    assert len(consumer.inbox) == 0 and len(producer.handbacks) == 0, "the handoff was released"
    assert store.calls == [], "nothing went through the store"


def test_well_formed_kv_through_the_same_path_is_loaded_not_recomputed(pair, tiny_model):
    """The control: the same path with the export intact loads it (no refusal, no recompute)."""
    policy, prefill, decode, producer, consumer, store = pair
    prompt = random_prompts([PROMPT_LEN], 1000, seed=48)[0]
    rid = f"{policy}-intact"
    worker = decode.core.executor.worker.kv_connector
    before = dict(worker.stats)
    producer.handbacks.expect(rid)
    req = prefill.process({"prompt_token_ids": prompt}, PARAMS, rid)
    prefill.add(prefill_request(req, rid))
    first = _run(prefill, rid)
    consumer.inbox.deliver(rid, _reply(producer.handbacks.take(rid)))
    decode.add(decode_request(req, first))
    last = _run(decode, rid).outputs[0]
    assert [first.outputs[0].token_ids[0], *last.token_ids] == hf_greedy(tiny_model, [prompt], PARAMS.max_tokens)[0]
    assert worker.stats["loads"] == before["loads"] + 1
    assert {k: v for k, v in worker.stats.items() if k.startswith("refused_")} == \
        {k: v for k, v in before.items() if k.startswith("refused_")}
    assert len(consumer.inbox) == 0 and store.calls == []


class _InProcessPeers:
    """cluster.pd.flow's peers over the two in-process engines, the KV handed back as a reply would
    be, `malform`ed on its way to the consumer's inbox."""

    def __init__(self, pair, malform) -> None:
        _, self.prefill_engine, self.decode_engine, self.producer, self.consumer, _ = pair
        self.malform = malform

    async def prefill(self, request):
        transfer_id = request.kv_transfer_params.transfer_id
        self.producer.handbacks.expect(transfer_id)
        self.prefill_engine.add(request)
        first = _run(self.prefill_engine, request.request_id)
        self.consumer.inbox.deliver(transfer_id, self.malform(self.producer.handbacks.take(transfer_id)))
        return first

    async def decode(self, request):
        self.decode_engine.add(request)
        while True:
            for out in self.decode_engine.step():
                if out.request_id == request.request_id:
                    yield out
                    if out.finished:
                        return

    async def cleanup(self, request_id, transfer_id, unfinished):
        if unfinished:
            self.prefill_engine.abort_request(request_id)
            self.decode_engine.abort_request(request_id)
        if transfer_id is not None:
            self.consumer.inbox.forget(transfer_id)


def test_the_pd_flow_fails_with_a_503_and_retry_after_or_recomputes(pair, tiny_model):
    """The request's whole path (cluster.pd.flow.pd_flow): with "fail" its error is the ingress's
    503 with Retry-After (cluster.http.errors), never a 200; with "recompute" transformers' tokens."""
    policy, prefill, decode, producer, consumer, _ = pair
    prompt = random_prompts([PROMPT_LEN], 1000, seed=49)[0]
    request = prefill.process({"prompt_token_ids": prompt}, PARAMS, f"flow-{policy}")

    async def run():
        last = None
        async for out in pd_flow(_InProcessPeers(pair, MALFORMED["dtype"]), request, load_failure_policy=policy):
            last = out
        return last

    if policy == "fail":
        with pytest.raises(ReplicaError, match=r"malformed KV \(dtype\)") as e:
            asyncio.run(run())
        error = replica_error(e.value)
        assert error.status == 503 and int(error.headers["Retry-After"]) > 0
    else:
        out = asyncio.run(run())
        assert out.finished and out.outputs[0].token_ids == hf_greedy(tiny_model, [prompt], PARAMS.max_tokens)[0]
    kv_manager = decode.core.kv_cache_manager
    assert kv_manager.get_num_free_blocks() == kv_manager.num_blocks and not decode.has_unfinished_requests()
    assert len(consumer.inbox) == 0 and len(producer.handbacks) == 0
