"""Driver run by test_multinode in its own process (this test process has its own Ray): it
joins the cluster in RAY_ADDRESS through cluster.launch.ray_connect, runs one P/D request with the
prefill worker on node A and the decode worker on node B, and prints a JSON report."""

from __future__ import annotations

import asyncio
import json
import sys


def main(model: str, prompt_ids: list[int]) -> dict:
    import ray

    from cluster.launch.ray_connect import RayConnectError, connect
    from cluster.pd.actor_peers import pd_generate
    from cluster.replica.host import EngineHost
    from engine import EngineArgs, SamplingParams
    from engine.llm_engine import load_processor
    from kvstore.store_actor import create_store

    try:
        connect(log_to_driver=False)
    except RayConnectError as e:
        return {"error": str(e)}
    import time

    deadline = time.monotonic() + 180
    while not {"node_a", "node_b"} <= set(ray.cluster_resources()):
        if time.monotonic() > deadline:  # the second node never joined: say so, do not hang
            return {"error": f"nodes missing after 180 s: {sorted(ray.cluster_resources())}"}
        time.sleep(0.5)  # polling the cluster's membership, bounded
    args = EngineArgs(model, max_model_len=256, num_kv_blocks=64)
    store = create_store()

    def worker(role, node):
        return ray.remote(EngineHost).options(num_cpus=0, max_concurrency=100, resources={node: 1}).remote(
            args, role, store=store)

    prefill, decode = worker("prefill", "node_a"), worker("decode", "node_b")
    ray.get([prefill.ping.remote(), decode.ping.remote()], timeout=240)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    _, processor = load_processor(args.create_engine_config())  # the input processing, here
    request = processor.process({"prompt_token_ids": prompt_ids}, params, "mn-1")

    async def run():
        last = None
        async for out in pd_generate(prefill, decode, store, request):
            last = out
        return last

    out = asyncio.run(run())
    return {"tokens": list(out.outputs[0].token_ids),
            "prefill_node": ray.get(prefill.node_id.remote()), "decode_node": ray.get(decode.node_id.remote()),
            "bytes_in": ray.get(decode.kv_transfer_stats.remote()).get("bytes_in", 0),
            "nodes": len([n for n in ray.nodes() if n["Alive"]])}


if __name__ == "__main__":
    print("REPORT " + json.dumps(main(sys.argv[1], json.loads(sys.argv[2]))), flush=True)
