"""The shared KV tier (`--kv-shared-tier-size`) across replicas: time to first token of
questions on long documents that another replica has already read, with the tier and without
it, side by side in one run.

Round 1: engine A (a replica) answers one question on each of N documents of about L tokens
(cold: every prompt is computed; A puts their full blocks in the tier). Round 2: the same
questions go to engines that never saw them: B, which shares A's tier (it loads the blocks A
computed), and C, which has no tier (it computes every prompt again, as any replica other than
A does today). B's and C's requests alternate, one at a time, so a shared machine slows both
alike. All three engines live in this process, on a local Ray (the tier's directory is the KV
store actor, the blocks' bytes are in Ray's object store).

    python scripts/bench_shared_tier.py                      # 8 x 1500 tokens, the default model
    python scripts/bench_shared_tier.py --num-docs 4 --doc-tokens 500

The first line names the CPU and the ISA level of pdserve's kernels. Prints mean TTFT per
engine, B's over C's, the tokens each computed (noise-free), and B's tier counters.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from scripts.bench_long_doc_qa import add_document_args, cpu_name, documents, max_model_len, ttft


def wait_listed(engine, blocks: int, bound_s: float = 60.0) -> None:
    """Until `engine`'s mirror of the tier lists `blocks` blocks (A's stores have landed)."""
    index = engine.core.scheduler.remote_kv.connector.index
    deadline = time.monotonic() + bound_s
    while len(index) < blocks:
        if time.monotonic() > deadline:
            raise SystemExit(f"the tier lists {len(index)} of {blocks} blocks after {bound_s} s")
        time.sleep(0.05)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_document_args(p)
    p.add_argument("--kv-shared-tier-size", type=float, default=1.0, help="the tier's GiB")
    args = p.parse_args()

    import ray

    from engine import SamplingParams
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from engine.models.default_model import default_model
    from kvstore.shared_tier import with_shared_tier
    from kvstore.store_actor import create_store

    model = args.model or default_model()
    common = dict(max_model_len=max_model_len(args), block_size=args.block_size)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        store = create_store()

        def shared(replica_id: str) -> LLMEngine:
            config = EngineArgs.from_kwargs(model, kv_shared_tier_size=args.kv_shared_tier_size,
                                            **common).create_engine_config()
            return LLMEngine(config, with_shared_tier(config, store, replica_id, None))

        a, b = shared("A"), shared("B")
        engines = {"A": a, "B": b, "C": LLMEngine(EngineArgs.from_kwargs(model, **common).create_engine_config())}
        warmup, *docs = documents(a.tokenizer, args.num_docs + 1, args.doc_tokens, args.seed)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        for name, engine in engines.items():
            # A first request pays one-time costs (first-touch memory, kernel shapes): not timed.
            ttft(engine, f"warmup-{name}", warmup, params)
            engine.core.reset_prefix_cache()
        print(f"CPU {cpu_name()}; pdserve's kernels: ISA level {a.core.cpu_kernels}; {os.cpu_count()} cores; "
              f"torch threads {__import__('torch').get_num_threads()}")
        print(f"model {os.path.basename(model.rstrip('/'))}; {args.num_docs} documents x {len(docs[0])} tokens; "
              f"shared tier {args.kv_shared_tier_size:g} GiB (A and B)")
        times = {name: [] for name in engines}
        computed = {}
        before = a.core.num_scheduled_tokens
        for i, doc in enumerate(docs):
            times["A"].append(ttft(a, f"a-d{i}", doc, params))
            print(f"round 1 document {i} A: TTFT {times['A'][-1]:.3f} s", file=sys.stderr, flush=True)
        computed["A"] = a.core.num_scheduled_tokens - before
        # The warm-up's blocks are in the tier too; B must see every document's.
        wait_listed(b, (args.num_docs + 1) * (len(docs[0]) - 1) // args.block_size)
        before = {name: engines[name].core.num_scheduled_tokens for name in ("B", "C")}
        for i, doc in enumerate(docs):
            for name in ("B", "C"):  # alternated: both see the same machine
                times[name].append(ttft(engines[name], f"{name}-d{i}", doc, params))
                print(f"round 2 document {i} {name}: TTFT {times[name][-1]:.3f} s", file=sys.stderr, flush=True)
        for name in ("B", "C"):
            computed[name] = engines[name].core.num_scheduled_tokens - before[name]
        mean = {k: sum(v) / len(v) for k, v in times.items()}
        print("| engine | what it has | mean TTFT s | tokens computed |")
        print("| --- | --- | --- | --- |")
        print(f"| A (round 1) | nothing: computes | {mean['A']:.3f} | {computed['A']} |")
        print(f"| B (round 2) | the shared tier | {mean['B']:.3f} | {computed['B']} |")
        print(f"| C (round 2) | no tier: computes | {mean['C']:.3f} | {computed['C']} |")
        print(f"B / C mean TTFT: {mean['B'] / mean['C']:.2f}")
        stats = b.core.kv_transfer_stats()
        print(f"B's tier: {stats['shared_loads']} blocks loaded ({stats['shared_hit_tokens']} tokens), "
              f"{stats['shared_refused']} refused, {stats['shared_load_failures']} load failures")
        for name, engine in engines.items():
            c = engine.core
            assert c.num_free_blocks() == c.num_kv_blocks, f"{name}: KV blocks still held after the run"
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
