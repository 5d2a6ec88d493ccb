"""Tensor parallel on Ray ("ray" executor, the default inside the cluster) in an engine actor
outside Serve: the executor makes its own placement group for its two rank actors. Tokens equal
Hugging Face; a killed rank fails its engine with an error, not a hang, and takes its survivor
and its group with it. One colocated actor for the module (each start makes a placement group
and two rank actors that load torch); the last test kills a rank. P/D with tensor-parallel
roles, one KV shard per rank per request, runs behind Serve in tests/cluster/test_serve_tp.py."""

from __future__ import annotations

import asyncio

import pytest
import ray as ray_module

from cluster.pd.actor_peers import colocated_generate
from cluster.replica.host import start_host_actor
from engine import EngineArgs, SamplingParams
from tests.actors.helpers import collect, engine_request
from tests.engine.hf_reference import hf_greedy, random_prompts

ENGINE = {"max_model_len": 256, "num_kv_blocks": 64, "tensor_parallel_size": 2, "max_num_batched_tokens": 128}


@pytest.fixture(scope="module")
def tp_worker(ray_local, tiny_model):
    ray = ray_local
    groups = _live_placement_groups(ray)
    worker = start_host_actor(EngineArgs(tiny_model, **ENGINE), "colocated")
    ray.get(worker.ping.remote())
    assert _live_placement_groups(ray) == groups + 1  # the executor's own group
    yield ray, worker
    ray.kill(worker)


def _live_placement_groups(ray) -> int:
    return sum(1 for pg in ray.util.placement_group_table().values() if pg["state"] == "CREATED")


def test_tp2_ranks_answer_like_transformers_and_free_every_block(tp_worker, tiny_model):
    ray, worker = tp_worker
    assert len(ray.get(worker.tensor_parallel_ranks.remote())) == 2
    prompts = random_prompts([4, 19, 45], 1000, seed=31)
    params = SamplingParams(temperature=0, max_tokens=8)

    async def main():
        return await asyncio.gather(*[collect(colocated_generate(worker, engine_request(
            tiny_model, {"prompt_token_ids": p}, params, f"tp{i}", ENGINE))) for i, p in enumerate(prompts)])

    outs = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_model, prompts, 8)
    load = ray.get(worker.load.remote()).engine
    assert load.running == load.waiting == 0 and load.free_blocks == load.total_blocks


# Last: it kills a rank of the module's engine.
def test_a_killed_rank_fails_the_request_and_the_health_check_and_removes_the_group(tp_worker, tiny_model):
    ray, worker = tp_worker
    ranks = ray.get(worker.tensor_parallel_ranks.remote())
    groups = _live_placement_groups(ray)
    params = SamplingParams(temperature=0, max_tokens=8)
    request = engine_request(tiny_model, {"prompt_token_ids": [5, 6, 7, 8]}, params, "dead", ENGINE)
    ray.kill(ranks[1])
    with pytest.raises(Exception, match="tensor-parallel rank 1"):
        asyncio.run(collect(colocated_generate(worker, request)))
    with pytest.raises(ray_module.exceptions.RayTaskError, match="rank 1"):
        ray.get(worker.check_health.remote())
    # The survivor is killed with it and the engine's placement group removed.
    with pytest.raises(ray_module.exceptions.RayActorError):
        ray.get(ranks[0].ping.remote(), timeout=60)
    assert _live_placement_groups(ray) == groups - 1
