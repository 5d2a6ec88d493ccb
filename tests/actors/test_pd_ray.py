"""Disaggregated P/D on local Ray: prefill and decode actors, the KV store actor, the object
store transport. Tokens equal the colocated run and Hugging Face; nothing leaks."""

from __future__ import annotations

import asyncio

import pytest

from cluster.pd.actor_peers import colocated_generate, pd_generate
from cluster.replica.host import start_host_actor
from engine import EngineArgs, SamplingParams
from kvstore.store_actor import create_store
from tests.actors.helpers import ENGINE, assert_no_leaks, engine_request
from tests.engine.hf_reference import hf_greedy, random_prompts


@pytest.fixture(scope="module")
def cluster(ray_local, tiny_model):
    # The object-store transport; the torch_dist one has its own module
    # (test_torch_dist_transport.py: HF tokens, failures), so it does not pay for a second pair.
    ray = ray_local
    store = create_store()
    kw = {"store": store, "transport": "object_store"}
    prefill = start_host_actor(EngineArgs(tiny_model, **ENGINE), "prefill", **kw)
    decode = start_host_actor(EngineArgs(tiny_model, **ENGINE), "decode", **kw)
    colocated = start_host_actor(EngineArgs(tiny_model, **ENGINE), "colocated")
    ray.get([prefill.ping.remote(), decode.ping.remote(), colocated.ping.remote()])
    yield ray, store, prefill, decode, colocated
    for actor in (prefill, decode, colocated, store):
        ray.kill(actor)


async def _collect(stream):
    last = None
    async for out in stream:
        last = out
    return last


def test_pd_greedy_equals_colocated_and_transformers(cluster, tiny_model):
    ray, store, prefill, decode, colocated = cluster
    prompts = random_prompts([4, 19, 33, 60, 7], 1000, seed=31)
    params = SamplingParams(temperature=0, max_tokens=10)

    async def main():
        pd = [_collect(pd_generate(prefill, decode, store,
                                   engine_request(tiny_model, {"prompt_token_ids": p}, params, f"pd{i}")))
              for i, p in enumerate(prompts)]
        co = [_collect(colocated_generate(colocated,
                                          engine_request(tiny_model, {"prompt_token_ids": p}, params, f"co{i}")))
              for i, p in enumerate(prompts)]
        return await asyncio.gather(*pd), await asyncio.gather(*co)

    pd_outs, co_outs = asyncio.run(main())
    ref = hf_greedy(tiny_model, prompts, 10)
    for p_out, c_out, r in zip(pd_outs, co_outs, ref):
        assert p_out.outputs[0].token_ids == c_out.outputs[0].token_ids == r
        assert p_out.outputs[0].text == c_out.outputs[0].text
        assert p_out.outputs[0].finish_reason == c_out.outputs[0].finish_reason
    assert_no_leaks(ray, store, prefill, decode, colocated)


def test_pd_stream_deltas_add_up(cluster, tiny_model):
    ray, store, prefill, decode, _ = cluster
    request = engine_request(tiny_model, "The river ran", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                             "s1")

    async def main():
        text, ids, last = "", [], None
        async for out in pd_generate(prefill, decode, store, request):
            text += out.delta_text
            ids += out.delta_token_ids
            last = out
        return text, ids, last

    text, ids, last = asyncio.run(main())
    assert ids == last.outputs[0].token_ids and len(ids) == 8
    assert text == last.outputs[0].text and last.finished
    assert_no_leaks(ray, store, prefill, decode)


def test_one_token_request_is_served_by_prefill_alone(cluster, tiny_model):
    ray, store, prefill, decode, _ = cluster
    request = engine_request(tiny_model, "hello", SamplingParams(temperature=0, max_tokens=1), "one")
    out = asyncio.run(_collect(pd_generate(prefill, decode, store, request)))
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    assert_no_leaks(ray, store, prefill, decode)


def test_workers_report_health_and_load(cluster):
    ray, store, prefill, decode, colocated = cluster
    for worker, role in ((prefill, "prefill"), (decode, "decode"), (colocated, "colocated")):
        assert ray.get(worker.check_health.remote()) is None
        report = ray.get(worker.load.remote())
        assert report.role == role and report.engine.total_blocks == ENGINE["num_kv_blocks"]
        assert report.engine.kv_usage == 0.0 and report.engine.prefix_cache_hit_rate == 0.0


def test_invalid_worker_settings_fail_clearly(ray_local, tiny_model):
    from cluster.replica.host import EngineHost

    with pytest.raises(ValueError, match="role"):
        EngineHost(EngineArgs(tiny_model), role="router")
    with pytest.raises(ValueError, match="transport"):
        EngineHost(EngineArgs(tiny_model), role="decode", transport="carrier-pigeon")
    with pytest.raises(ValueError, match="KV store"):
        EngineHost(EngineArgs(tiny_model), role="decode")
