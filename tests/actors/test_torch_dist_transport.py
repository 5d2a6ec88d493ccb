"""The torch.distributed transport (gloo on CPU) over lazily created pairwise groups."""

from __future__ import annotations

import asyncio

import pytest

from cluster.pd.actor_peers import pd_generate
from cluster.pd.flow import pd_flow
from cluster.pd.split import prefill_request
from cluster.replica.errors import ReplicaError
from engine import SamplingParams
from tests.actors.helpers import (
    ENGINE,
    assert_no_leaks,
    collect,
    decode_half,
    engine_request,
    make_prompt,
    transfer_lost_peers,
)
from tests.engine.hf_reference import hf_greedy

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
TD = {"transport": "torch_dist", "transport_timeout_s": 20.0}


@pytest.fixture(scope="module")
def shared(ray_local, tiny_model):
    """(store, prefill, decode) on the torch_dist transport, shared by the tests that neither
    kill nor reconfigure them (a worker start costs seconds of CPU); each test checks it
    leaves them clean."""
    from cluster.replica.host import start_host_actor
    from engine import EngineArgs
    from kvstore.store_actor import create_store

    store = create_store()
    # The fail policy (not the default): its test shares the pair.
    prefill, decode = (start_host_actor(EngineArgs(tiny_model, **ENGINE, kv_load_failure_policy="fail"), role,
                                     store=store, **TD) for role in ("prefill", "decode"))
    ray_local.get([prefill.ping.remote(), decode.ping.remote()])
    yield store, prefill, decode
    for actor in (prefill, decode, store):
        ray_local.kill(actor)


def test_one_pair_group_serves_many_transfers(pd, shared, tiny_model):
    ray = pd[0]
    store, prefill, decode = shared
    prompts = [make_prompt(seed=s) for s in (61, 62, 63)]

    async def main():
        return await asyncio.gather(*(collect(pd_generate(prefill, decode, store,
                                                          engine_request(tiny_model, p, PARAMS, f"t{i}")))
                                      for i, p in enumerate(prompts)))

    outs = asyncio.run(main())
    ref = hf_greedy(tiny_model, [p["prompt_token_ids"] for p in prompts], 6)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert_no_leaks(ray, store, prefill, decode)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_producer_death_before_send_is_a_load_failure(pd, shared, tiny_model, policy):
    ray, _, make = pd
    store, _, shared_decode = shared
    prefill = make("prefill", store, **TD)  # killed below
    decode = shared_decode if policy == "fail" else make("decode", store, load_failure_policy=policy, **TD)
    prompt = make_prompt(seed=64)
    request = engine_request(tiny_model, prompt, PARAMS, "d1")
    first = ray.get(prefill.prefill.remote(prefill_request(request)))
    ray.kill(prefill)  # the bytes lived only in the producer's outbox

    out = asyncio.run(decode_half(decode, request, first))
    if policy == "fail":
        assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
    else:
        tokens = list(first.outputs[0].token_ids) + list(out.outputs[0].token_ids)
        assert tokens == hf_greedy(tiny_model, [prompt["prompt_token_ids"]], 6)[0]
    ray.get(store.release.remote(first.kv_transfer_params.transfer_id))
    assert_no_leaks(ray, store, decode)


def test_released_or_expired_transfer_is_dropped_by_its_producer(pd, shared, tiny_model):
    ray = pd[0]
    store, prefill, _ = shared
    a = ray.get(prefill.prefill.remote(prefill_request(engine_request(tiny_model, make_prompt(seed=65), PARAMS, "x1"))))
    ray.get(prefill.prefill.remote(prefill_request(engine_request(tiny_model, make_prompt(seed=66), PARAMS, "x2"))))
    assert ray.get(prefill.outbox_size.remote()) == 2
    ray.get(store.release.remote(a.kv_transfer_params.transfer_id))
    ray.get(store.sweep.remote(advance_s=1000.0))
    assert_no_leaks(ray, store, prefill)


def test_orchestrated_failure_with_fail_policy_is_an_error(pd, shared, tiny_model):
    ray = pd[0]
    store, prefill, decode = shared
    request = engine_request(tiny_model, make_prompt(seed=67), PARAMS, "w")
    # The transfer is gone from the store before the decode replica loads it: the load fails.
    with pytest.raises(ReplicaError, match="KV load failed"):
        asyncio.run(collect(pd_flow(transfer_lost_peers(prefill, decode, store), request)))
    assert_no_leaks(ray, store, prefill, decode)
