"""P/D between tensor-parallel sizes that differ, on local Ray over gloo: a prefill of 2 ranks
into a decode of 1, and a prefill of 1 into a decode of 2 (the small preset: 8 heads, 4 KV
heads). Each decode rank re-shards the prefill's KV to its own heads (kvstore.reshard).

Oracles: Hugging Face greedy tokens; the decode's connector counters (every prompt loaded on
every rank, none refused, none failed, so no prompt was recomputed); no block, transfer or export
left. One module: the four engines (two with two rank actors each) start once."""

from __future__ import annotations

import asyncio

import pytest

from cluster.pd.actor_peers import pd_generate
from cluster.replica.host import start_host_actor
from engine import EngineArgs, SamplingParams
from kvstore.kv_io import REFUSAL_REASONS, refusal_key
from kvstore.store_actor import create_store
from tests.actors.helpers import assert_no_leaks, collect, engine_request
from tests.engine.hf_reference import hf_greedy, random_prompts

ENGINE = {"max_model_len": 256, "num_kv_blocks": 64, "max_num_batched_tokens": 128}
PROMPTS = random_prompts([5, 23, 40, 17], 1000, seed=7)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def small_model(model_factory):
    return model_factory("llama", "small")


@pytest.fixture(scope="module")
def engines(ray_local, small_model):
    ray = ray_local
    store = create_store()
    hosts = {}
    for role in ("prefill", "decode"):
        for tp in (1, 2):
            args = EngineArgs(small_model, tensor_parallel_size=tp, **ENGINE)
            # "fail": a load that went wrong is an error here, never a silent recompute.
            hosts[role, tp] = start_host_actor(args, role, store=store, load_failure_policy="fail")
    ray.get([h.ping.remote() for h in hosts.values()])
    yield ray, store, hosts
    ray.get([h.shutdown.remote() for h in hosts.values()])  # their ranks' placement groups too
    for actor in (*hosts.values(), store):
        ray.kill(actor)


@pytest.fixture(scope="module")
def expected(small_model):
    return hf_greedy(small_model, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_unequal_tensor_parallel_pd_equals_transformers_with_no_transfer_refused(
        engines, small_model, expected, prefill_tp, decode_tp):
    ray, store, hosts = engines
    prefill, decode = hosts["prefill", prefill_tp], hosts["decode", decode_tp]
    before = ray.get(decode.kv_transfer_stats.remote())
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)

    async def main():
        return await asyncio.gather(*[collect(pd_generate(prefill, decode, store, engine_request(
            small_model, {"prompt_token_ids": p}, params, f"tp{prefill_tp}to{decode_tp}-{i}", ENGINE)))
            for i, p in enumerate(PROMPTS)])

    outs = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = ray.get(decode.kv_transfer_stats.remote())
    moved = {k: stats[k] - before[k] for k in ("loads", "load_failures", *map(refusal_key, REFUSAL_REASONS))}
    assert moved == {"loads": decode_tp * len(PROMPTS), "load_failures": 0,
                     **{refusal_key(r): 0 for r in REFUSAL_REASONS}}
    assert_no_leaks(ray, store, prefill, decode)
