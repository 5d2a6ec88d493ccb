"""Disaggregated prefill/decode on local Ray, measured side by side in one run.

1. KV transfer per transport against KV size: prompts of several lengths go through
   prefill -> transfer -> decode; the decode side's connector times each load (fetch start to
   KV written into its blocks) and counts its bytes.
2. TTFT and ITL of P/D (1 prefill + 1 decode actor) against colocated (1 actor) on a mixed
   workload with Poisson arrivals.

    python scripts/bench_pd.py [--model DIR] [--requests 32] [--rate 4] [engine flags]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.args import EngineArgs  # noqa: E402  (after the path set-up above)


def _pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def _timed(stream):
    """(ttft, [inter-token gaps], n tokens) of one streamed request."""
    t0 = time.perf_counter()
    stamps, n = [], 0
    async for out in stream:
        if out.delta_token_ids:
            stamps.append(time.perf_counter())
            n += len(out.delta_token_ids)
    ttft = stamps[0] - t0
    return ttft, [b - a for a, b in zip(stamps, stamps[1:])], n


async def _one_pd(handles, processor, n, rid, params, rng, vocab):
    from cluster.pd.actor_peers import pd_generate

    prefill, decode, store = handles
    prompt = {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]}
    async for _ in pd_generate(prefill, decode, store, processor.process(prompt, params, rid)):
        pass


def bench_transfer(ray, engine_args, processor, lengths, vocab):
    from cluster.replica.host import start_host_actor
    from engine import SamplingParams
    from kvstore.store_actor import create_store

    print("\n== KV transfer (decode-side load: fetch start -> KV in blocks)")
    print(f"{'transport':<13} {'tokens':>7} {'KB':>9} {'ms':>8} {'MB/s':>8}")
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    rng = random.Random(0)
    for transport in ("object_store", "torch_dist"):
        store = create_store()
        kw = dict(store=store, transport=transport)
        prefill, decode = start_host_actor(engine_args, "prefill", **kw), start_host_actor(engine_args, "decode", **kw)
        ray.get([prefill.ping.remote(), decode.ping.remote()])

        handles = (prefill, decode, store)
        asyncio.run(_one_pd(handles, processor, lengths[0], "warm", params, rng, vocab))  # pair set-up, warm-up
        for n in lengths:
            before = ray.get(decode.kv_transfer_stats.remote())
            reps = 3
            for r in range(reps):
                asyncio.run(_one_pd(handles, processor, n, f"{transport}-{n}-{r}", params, rng, vocab))
            after = ray.get(decode.kv_transfer_stats.remote())
            secs = (after["load_seconds"] - before["load_seconds"]) / reps
            nbytes = (after["bytes_in"] - before["bytes_in"]) / reps
            print(f"{transport:<13} {n:>7} {nbytes / 1024:>9.1f} {secs * 1e3:>8.2f} {nbytes / secs / 1e6:>8.1f}")
        for actor in (prefill, decode, store):
            ray.kill(actor)


def bench_latency(ray, engine_args, processor, n_requests, rate, vocab, seed):
    from cluster.pd.actor_peers import colocated_generate, pd_generate
    from cluster.replica.host import start_host_actor
    from engine import SamplingParams
    from kvstore.store_actor import create_store

    rng = random.Random(seed)
    workload = [([rng.randrange(3, vocab) for _ in range(rng.randint(32, 512))], rng.randint(32, 96))
                for _ in range(n_requests)]
    gaps = [rng.expovariate(rate) for _ in workload]
    print(f"\n== TTFT / ITL, {n_requests} requests, prompts 32-512, outputs 32-96, Poisson {rate}/s")

    async def run(make_stream):
        async def delayed(i, p, o, delay):
            await asyncio.sleep(delay)  # arrival time of the request (the workload), not sync
            request = processor.process({"prompt_token_ids": p},
                                        SamplingParams(temperature=0, max_tokens=o, ignore_eos=True), f"r{i}")
            return await _timed(make_stream(request))
        t = 0.0
        tasks = []
        for i, ((p, o), g) in enumerate(zip(workload, gaps)):
            t += g
            tasks.append(delayed(i, p, o, t))
        start = time.perf_counter()
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start

    store = create_store()
    prefill = start_host_actor(engine_args, "prefill", store=store)
    decode = start_host_actor(engine_args, "decode", store=store)
    colocated = start_host_actor(engine_args, "colocated")
    ray.get([prefill.ping.remote(), decode.ping.remote(), colocated.ping.remote()])
    modes = {
        "colocated": lambda request: colocated_generate(colocated, request),
        "P/D": lambda request: pd_generate(prefill, decode, store, request),
    }
    print(f"{'mode':<10} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'ITL p50':>8} {'p90':>7} {'p99':>7} {'tok/s':>7}")
    for name, make in modes.items():
        for i in range(2):  # warm both paths (first transfer, first pair) before measuring
            asyncio.run(_timed(make(processor.process({"prompt_token_ids": workload[i][0]},
                                                      SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                                                      f"w{i}"))))
        results, wall = asyncio.run(run(make))
        ttft = [r[0] * 1e3 for r in results]
        itl = [g * 1e3 for r in results for g in r[1]]
        tokens = sum(r[2] for r in results)
        print(f"{name:<10} {_pct(ttft, .5):>9.1f} {_pct(ttft, .9):>7.1f} {_pct(ttft, .99):>7.1f} "
              f"{_pct(itl, .5):>8.1f} {_pct(itl, .9):>7.1f} {_pct(itl, .99):>7.1f} {tokens / wall:>7.1f}")
    print("(milliseconds; tok/s = output tokens / wall time of the run)")
    for actor in (prefill, decode, colocated, store):
        ray.kill(actor)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrival rate, requests/s")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--workload-seed", type=int, default=0)
    EngineArgs.add_cli_args(ap)  # --model (default: the small preset, made on first use), engine flags
    ap.set_defaults(max_model_len=2048)
    args = ap.parse_args()

    import ray

    from engine.llm_engine import load_processor
    from engine.models.arch import load_arch
    from engine.models.default_model import ensure_preset_model

    engine_args = EngineArgs.from_cli_args(args, model=args.model or ensure_preset_model("small"))
    vocab = load_arch(engine_args.model).vocab_size - 64
    # The front end's input processor: the requests reach the workers processed, as from an ingress.
    _, processor = load_processor(engine_args.create_engine_config())
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        print(f"model={engine_args.model}")
        bench_transfer(ray, engine_args, processor, args.lengths, vocab)
        bench_latency(ray, engine_args, processor, args.requests, args.rate, vocab, args.workload_seed)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
