"""The shared KV tier between engine hosts (cluster.replica.host, as Ray actors sharing one KV
store): a prompt one colocated replica computed is loaded by another, with equal tokens; a
replica that stops hands its blocks to the store; a P/D replica gets the tier beside its P/D
connector."""

from __future__ import annotations

import asyncio
import time

from engine import SamplingParams
from tests.actors.helpers import ENGINE, engine_request
from tests.engine.hf_reference import hf_greedy, random_prompts

BS = 16
SHARED = {**ENGINE, "block_size": BS, "kv_shared_tier_size": 0.01}
PARAMS = SamplingParams(temperature=0, max_tokens=6)


async def _generate(host, request):
    last = None
    async for ref in host.generate.remote(request):
        last = await ref
    return last


def _wait(fn, what: str, bound_s: float = 30.0) -> None:
    deadline = time.monotonic() + bound_s
    while not fn():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_prompt_computed_by_one_replica_is_loaded_by_another(pd, tiny_model):
    ray, store, make = pd
    a = make("colocated", store, engine_kwargs=SHARED, replica_id="A")
    b = make("colocated", store, engine_kwargs=SHARED, replica_id="B")
    [prompt] = random_prompts([120], 1000, seed=5)
    shared_blocks = (len(prompt) - 1) // BS

    def request(rid):
        return engine_request(tiny_model, {"prompt_token_ids": prompt}, PARAMS, rid, engine_kwargs=SHARED)

    out_a = asyncio.run(_generate(a, request("a")))
    _wait(lambda: ray.get(store.shared_stats.remote())["blocks"] >= shared_blocks, "A's blocks in the directory")
    time.sleep(0.5)  # B's mirror polls every 0.2 s
    out_b = asyncio.run(_generate(b, request("b")))
    assert out_b.num_cached_tokens == shared_blocks * BS
    assert out_b.outputs[0].token_ids == out_a.outputs[0].token_ids == hf_greedy(tiny_model, [prompt], 6)[0]
    assert ray.get(b.kv_transfer_stats.remote())["shared_loads"] == shared_blocks
    for report in ray.get([a.load.remote(), b.load.remote()]):
        assert report.engine.free_blocks == report.engine.total_blocks
    # A leaves: before it goes, the store copies the blocks it put (their objects would go with
    # its process), so the directory keeps them and drops none.
    held = ray.get(store.shared_stats.remote())["blocks"]
    ray.get(a.shutdown.remote())  # returns once the store has adopted them (bounded)
    stats = ray.get(store.shared_stats.remote())
    assert stats["blocks"] == held >= shared_blocks and stats["owner_dropped"] == 0, stats


def test_a_pd_replica_gets_the_tier_beside_its_pd_connector(pd, tiny_model):
    ray, store, make = pd
    decode = make("decode", store, engine_kwargs=SHARED, replica_id="D")
    stats = ray.get(decode.kv_transfer_stats.remote())
    assert "loads" in stats and "shared_loads" in stats  # the P/D connector's and the tier's
