"""Tensor parallel on Ray ("ray" executor, the default inside the cluster): prefill and decode
actors of two rank actors each, the prompt KV moved rank by rank (each rank's heads). Tokens
equal Hugging Face; nothing leaks; a killed rank fails its engine with an error, not a hang.
One P/D pair for the module (each start makes a placement group and two rank actors that load
torch); the last test kills a decode rank."""

from __future__ import annotations

import asyncio

import pytest
import ray as ray_module

from actors import create_worker, pd_generate
from engine import EngineArgs, SamplingParams
from kvstore.store_actor import create_store
from tests.actors.helpers import assert_no_leaks, collect
from tests.engine.hf_reference import hf_greedy, random_prompts

ENGINE = {"max_model_len": 256, "num_kv_blocks": 64, "tensor_parallel_size": 2, "max_num_batched_tokens": 128}


@pytest.fixture(scope="module")
def tp_pd(ray_local, tiny_model):
    ray = ray_local
    store = create_store()
    prefill = create_worker(EngineArgs(tiny_model, **ENGINE), "prefill", store=store)
    decode = create_worker(EngineArgs(tiny_model, **ENGINE), "decode", store=store)
    ray.get([prefill.ping.remote(), decode.ping.remote()])
    groups = _live_placement_groups(ray)
    yield ray, store, prefill, decode
    ray.get([prefill.shutdown.remote(), decode.shutdown.remote()])
    for actor in (prefill, decode, store):
        ray.kill(actor)
    assert _live_placement_groups(ray) == groups - 2  # each engine removed its own group


def _live_placement_groups(ray) -> int:
    return sum(1 for pg in ray.util.placement_group_table().values() if pg["state"] == "CREATED")


def test_pd_with_tp2_roles_equals_transformers_and_moves_kv_per_rank(tp_pd, tiny_model):
    ray, store, prefill, decode = tp_pd
    assert len(ray.get(decode.tensor_parallel_ranks.remote())) == 2
    prompts = random_prompts([4, 19, 45], 1000, seed=31)
    params = SamplingParams(temperature=0, max_tokens=8)

    async def main():
        return await asyncio.gather(*[collect(pd_generate(prefill, decode, store, {"prompt_token_ids": p},
                                                          params, f"tp{i}")) for i, p in enumerate(prompts)])

    outs = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_model, prompts, 8)
    # One shard per rank per request, each half of the heads.
    exported, loaded = ray.get([prefill.kv_transfer_stats.remote(), decode.kv_transfer_stats.remote()])
    assert exported["exports"] == loaded["loads"] == 2 * len(prompts)
    assert exported["bytes_out"] == loaded["bytes_in"] > 0 and loaded["load_failures"] == 0
    assert_no_leaks(ray, store, prefill, decode)


# Last: it kills a rank of the module's decode engine.
def test_a_killed_decode_rank_fails_the_request_and_the_health_check(tp_pd):
    ray, store, prefill, decode = tp_pd
    ranks = ray.get(decode.tensor_parallel_ranks.remote())
    groups = _live_placement_groups(ray)
    ray.kill(ranks[1])
    params = SamplingParams(temperature=0, max_tokens=8)
    with pytest.raises(Exception, match="tensor-parallel rank 1"):
        asyncio.run(collect(pd_generate(prefill, decode, store, {"prompt_token_ids": [5, 6, 7, 8]}, params, "dead")))
    with pytest.raises(ray_module.exceptions.RayTaskError, match="rank 1"):
        ray.get(decode.check_health.remote())
    # The survivor is killed with it and the engine's placement group removed.
    with pytest.raises(ray_module.exceptions.RayActorError):
        ray.get(ranks[0].ping.remote(), timeout=60)
    assert _live_placement_groups(ray) == groups - 1
    assert ray.get(prefill.check_health.remote()) is None  # the other role is untouched
