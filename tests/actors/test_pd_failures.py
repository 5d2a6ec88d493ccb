"""P/D failures on local Ray. After each, free KV blocks on the surviving replicas and live
transfers in the store return to their baseline, and no request returns tokens computed
from wrong or partial KV."""

from __future__ import annotations

import asyncio

import pytest

from cluster.pd.actor_peers import pd_generate
from cluster.pd.flow import pd_flow
from cluster.pd.split import prefill_request
from cluster.replica.errors import ReplicaError
from engine import EngineArgs, SamplingParams
from engine.load import EngineLoad
from kvstore.store_actor import create_store
from tests.actors.helpers import (
    ENGINE,
    assert_no_leaks,
    collect,
    decode_half,
    engine_request,
    make_prompt,
    transfer_lost_peers,
    wait_until,
)
from tests.engine.hf_reference import hf_greedy

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def shared(ray_local, tiny_model):
    """(store, prefill, decode): default workers for the tests that neither kill them nor need
    other settings. Each worker start imports torch and loads an engine (seconds of CPU), so
    the module shares one pair; a test that kills a worker or changes one makes its own with
    `pd`'s factory, on this store. Every test checks the shared pair is left clean."""
    from cluster.replica.host import start_host_actor

    store = create_store()
    # The fail policy (not the default): the tests of it share the pair.
    prefill, decode = (start_host_actor(EngineArgs(tiny_model, **ENGINE, kv_load_failure_policy="fail"), role,
                                     store=store) for role in ("prefill", "decode"))
    ray_local.get([prefill.ping.remote(), decode.ping.remote()])
    yield store, prefill, decode
    for actor in (prefill, decode, store):
        ray_local.kill(actor)


class HangingEngine:
    """A fake engine whose requests never finish until aborted."""

    def __init__(self, config, connector) -> None:
        self.requests: dict[str, asyncio.Event] = {}

    async def generate(self, request, **kw):
        request_id = request.request_id
        event = self.requests[request_id] = asyncio.Event()
        await event.wait()
        del self.requests[request_id]
        if False:
            yield None

    async def abort(self, request_id):
        if request_id in self.requests:
            self.requests[request_id].set()

    async def load(self):
        return EngineLoad(running=len(self.requests), free_blocks=1, total_blocks=1)

    async def check_health(self):
        pass

    def shutdown(self):
        pass


class SilentStore:
    """The real store as the decode replica sees it, but lookups never answer: the transfer
    stays in flight. Releases go through to the real store."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.never = asyncio.Event()

    async def lookup(self, transfer_id, wait_s=0.0):
        if transfer_id.startswith("warmup-"):
            return None  # lets the worker start
        await self.never.wait()

    async def release(self, transfer_id):
        return await self.inner.release.remote(transfer_id)

    async def register(self, *args, **kwargs):
        return {"ok": True}

    async def abandon(self, transfer_id, reason):
        pass


def test_kv_load_failure_with_fail_policy_is_an_error(pd, shared, tiny_model):
    ray = pd[0]
    store, prefill, decode = shared
    request = engine_request(tiny_model, make_prompt(), PARAMS, "f1")
    with pytest.raises(ReplicaError, match="KV load failed"):
        asyncio.run(collect(pd_flow(transfer_lost_peers(prefill, decode, store), request)))
    assert_no_leaks(ray, store, prefill, decode)


def test_kv_load_failure_with_recompute_policy_gives_correct_tokens(pd, shared, tiny_model):
    ray, _, make = pd
    store, prefill, _ = shared
    decode = make("decode", store, load_failure_policy="recompute")
    prompt = make_prompt(seed=42)
    request = engine_request(tiny_model, prompt, PARAMS, "f2")
    out = asyncio.run(collect(pd_flow(transfer_lost_peers(prefill, decode, store), request)))
    assert out.outputs[0].token_ids == hf_greedy(tiny_model, [prompt["prompt_token_ids"]], 8)[0]
    assert_no_leaks(ray, store, prefill, decode)


def test_prefill_death_during_prefill_is_an_error(pd, shared, tiny_model):
    ray, _, make = pd
    store, _, decode = shared
    prefill = make("prefill", store, engine_cls=HangingEngine)
    request = engine_request(tiny_model, make_prompt(), PARAMS, "f3")

    async def main():
        task = asyncio.ensure_future(collect(pd_generate(prefill, decode, store, request)))
        await wait_until(lambda: _running(prefill), "the prefill to start")
        ray.kill(prefill)
        return await task

    with pytest.raises(ReplicaError, match="prefill replica died"):
        asyncio.run(main())
    assert_no_leaks(ray, store, decode)


async def _running(actor) -> bool:
    return (await actor.load.remote()).engine.running > 0


def test_prefill_death_after_prefill_does_not_lose_the_kv(pd, shared, tiny_model):
    ray, _, make = pd
    store, _, decode = shared
    prefill = make("prefill", store)
    prompt = make_prompt(seed=43)
    request = engine_request(tiny_model, prompt, PARAMS, "f4")
    first = ray.get(prefill.prefill.remote(prefill_request(request)))
    entry = ray.get(store.lookup.remote(first.kv_transfer_params.transfer_id, 10.0))
    ray.wait(entry["refs"])  # the export has reached the object store, owned by the store
    ray.kill(prefill)

    out = asyncio.run(decode_half(decode, request, first))
    tokens = list(first.outputs[0].token_ids) + list(out.outputs[0].token_ids)
    assert tokens == hf_greedy(tiny_model, [prompt["prompt_token_ids"]], 8)[0]
    assert_no_leaks(ray, store, decode)


def test_decode_death_mid_decode_is_an_error(pd, shared, tiny_model):
    ray, _, make = pd
    store, prefill, _ = shared
    decode = make("decode", store)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    request = engine_request(tiny_model, make_prompt(seed=44), params, "f5")

    async def main():
        seen = 0
        async for _ in pd_generate(prefill, decode, store, request):
            seen += 1
            if seen == 3:  # first token from prefill, then decode tokens are flowing
                ray.kill(decode)

    with pytest.raises(ReplicaError, match="decode replica died"):
        asyncio.run(main())
    assert_no_leaks(ray, store, prefill)


def _abort_after(stream_factory, n_outputs: int):
    async def main():
        stream = stream_factory()
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == n_outputs:
                break
        await stream.aclose()
        return seen

    return asyncio.run(main())


def test_abort_after_prefill_before_decode_releases_the_transfer(pd, shared, tiny_model):
    ray = pd[0]
    store, prefill, decode = shared
    request = engine_request(tiny_model, make_prompt(seed=45), PARAMS, "a1")
    seen = _abort_after(lambda: pd_generate(prefill, decode, store, request), 1)
    assert seen == 1
    assert_no_leaks(ray, store, prefill, decode)


def test_abort_mid_decode_frees_decode_blocks(pd, shared, tiny_model):
    ray = pd[0]
    store, prefill, decode = shared
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    request = engine_request(tiny_model, make_prompt(seed=46), params, "a2")
    _abort_after(lambda: pd_generate(prefill, decode, store, request), 4)
    assert_no_leaks(ray, store, prefill, decode)


def test_abort_during_transfer_frees_blocks_on_decode(pd, shared, ray_local, tiny_model):
    ray, _, make = pd
    store, prefill, _ = shared
    silent = ray_local.remote(SilentStore).options(num_cpus=0, max_concurrency=100).remote(store)
    decode = make("decode", silent)
    request = engine_request(tiny_model, make_prompt(seed=47), PARAMS, "a3")

    async def main():
        task = asyncio.ensure_future(collect(pd_generate(prefill, decode, store, request)))
        await wait_until(lambda: _waiting(decode), "the decode side to wait for KV")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert_no_leaks(ray, store, prefill, decode)
    ray.kill(silent)


async def _waiting(actor) -> bool:
    return (await actor.load.remote()).engine.waiting > 0


def test_abort_while_queued_for_prefill(pd, shared, tiny_model):
    ray, _, make = pd
    store, _, decode = shared
    # One sequence at a time and a tiny token budget: a long prompt occupies the prefill
    # replica for many steps while the next request waits in its queue.
    prefill = make("prefill", store, engine_kwargs={**ENGINE, "max_num_seqs": 1, "max_num_batched_tokens": 2})
    busy = engine_request(tiny_model, make_prompt(seed=48, n=200), PARAMS, "busy")
    waiting = engine_request(tiny_model, make_prompt(seed=49), PARAMS, "q")

    async def main():
        long = asyncio.ensure_future(collect(pd_generate(prefill, decode, store, busy)))
        queued = asyncio.ensure_future(collect(pd_generate(prefill, decode, store, waiting)))
        await wait_until(lambda: _waiting(prefill), "a request queued on prefill")
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        return await long

    out = asyncio.run(main())
    assert len(out.outputs[0].token_ids) == 8
    assert_no_leaks(ray, store, prefill, decode)


def test_lease_expiry_frees_unclaimed_transfers(pd, shared, tiny_model):
    ray = pd[0]
    store, prefill, _ = shared
    first = ray.get(prefill.prefill.remote(prefill_request(engine_request(tiny_model, make_prompt(seed=50), PARAMS,
                                                                          "l1"))))
    ray.get(store.lookup.remote(first.kv_transfer_params.transfer_id, 10.0))  # registered by now
    assert ray.get(store.stats.remote())["live_transfers"] == 1
    assert ray.get(store.sweep.remote(advance_s=60.0)) == []
    assert ray.get(store.sweep.remote(advance_s=121.0)) == [first.kv_transfer_params.transfer_id]
    assert_no_leaks(ray, store, prefill)


def test_store_full_is_an_explicit_error(pd, ray_local, tiny_model):
    ray, _, make = pd
    full = create_store(max_bytes=64)  # room for the 4-byte warm-up, not for KV
    prefill, decode = make("prefill", full), make("decode", full, load_failure_policy="fail")
    request = engine_request(tiny_model, make_prompt(seed=51), PARAMS, "full")
    with pytest.raises(ReplicaError, match="KV store is full"):
        asyncio.run(collect(pd_generate(prefill, decode, full, request)))
    assert_no_leaks(ray, full, prefill, decode)
    assert ray.get(full.stats.remote())["rejected_full"] == 1
    ray.kill(full)
