"""P/D between tensor-parallel sizes that differ, on local Ray over gloo: a prefill of 2 ranks
into a decode of 1 (object store), and a prefill of 1 into a decode of 2 (torch_dist) (the small
preset: 8 heads, 4 KV heads). Each decode rank re-shards the prefill's KV to its own heads
(kvstore.reshard). Both directions over the object store, 16 prompts each, behind Serve:
scripts/pd_unequal_tp.py.

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
    """engine(role, tp, transport) -> a host actor, started on first use and kept for the module."""
    ray = ray_local
    store = create_store()
    hosts = {}

    def engine(role: str, tp: int, transport: str):
        if (role, tp, transport) not in hosts:
            args = EngineArgs(small_model, tensor_parallel_size=tp, **ENGINE)
            # "fail": a load that went wrong is an error here, never a silent recompute.
            hosts[role, tp, transport] = start_host_actor(args, role, store=store, transport=transport,
                                                          load_failure_policy="fail")
        return hosts[role, tp, transport]

    yield ray, store, engine
    ray.get([h.shutdown.remote() for h in hosts.values()])  # their ranks' placement groups too
    for actor in (*hosts.values(), store):
        ray.kill(actor)


@pytest.fixture(scope="module")
def expected(small_model):
    return hf_greedy(small_model, PROMPTS, MAX_TOKENS)


# One direction per transport (each pair starts its own engines): the store's objects, which
# any number of decode ranks may read, from two prefill ranks into one decode rank; torch_dist,
# whose producer sends each export to each of its readers, from one prefill rank into two.
@pytest.mark.parametrize("prefill_tp,decode_tp,transport", [(2, 1, "object_store"), (1, 2, "torch_dist")])
def test_unequal_tensor_parallel_pd_equals_transformers_with_no_transfer_refused(
        engines, small_model, expected, prefill_tp, decode_tp, transport):
    ray, store, engine = engines
    prefill, decode = engine("prefill", prefill_tp, transport), engine("decode", decode_tp, transport)
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
