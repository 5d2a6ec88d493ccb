"""Images through disaggregated P/D on local Ray: the prefill side encodes, the decode side
gets the prompt's KV plus placeholders and hashes, never pixels. Oracle: HF LLaVA greedy."""

from __future__ import annotations

import asyncio

import pytest

from cluster.pd.actor_peers import pd_generate
from cluster.replica.host import start_host_actor
from engine import EngineArgs, SamplingParams
from kvstore.store_actor import create_store
from tests.actors.helpers import ENGINE, assert_no_leaks, collect, engine_request
from tests.engine.mm_reference import hf_llava_greedy, image

MAX_TOKENS = 6
_ENGINE = {**ENGINE, "block_size": 8}
TEXT = "Look at <image> and answer briefly"


@pytest.fixture(scope="module")
def cluster(ray_local, llava_model):
    ray = ray_local
    store = create_store()
    prefill = start_host_actor(EngineArgs(llava_model, **_ENGINE), "prefill", store=store)
    decode = start_host_actor(EngineArgs(llava_model, **_ENGINE), "decode", store=store)
    ray.get([prefill.ping.remote(), decode.ping.remote()])
    yield ray, store, prefill, decode
    for actor in (prefill, decode, store):
        ray.kill(actor)


def test_pd_with_images_equals_hf_and_decode_never_encodes(cluster, llava_model):
    ray, store, prefill, decode = cluster
    # The same text with two different images: the decode side's prefix cache must tell
    # their prompt blocks apart (image hashes in the block hashes), or the second reads the
    # first's KV.
    cases = [(TEXT, [image(30)]), (TEXT, [image(31)]), ("Two <image> and <image> here", [image(30), image(32)])]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def run(i, text, images):
        prompt = {"prompt": text, "multi_modal_data": {"image": images}}
        request = engine_request(llava_model, prompt, params, f"mm{i}", _ENGINE)
        return await collect(pd_generate(prefill, decode, store, request))

    outs = [asyncio.run(run(i, t, ims)) for i, (t, ims) in enumerate(cases)]
    for out, (text, images) in zip(outs, cases):
        assert out.outputs[0].token_ids == hf_llava_greedy(llava_model, text, images, MAX_TOKENS)
    p_load, d_load = ray.get([prefill.load.remote(), decode.load.remote()])
    assert p_load.engine.encoder_cache_queries == 4
    assert d_load.engine.encoder_cache_queries == 0  # decode loaded KV, it never ran the encoder
    assert_no_leaks(ray, store, prefill, decode)
