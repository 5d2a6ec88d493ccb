"""Batch throughput: the Ray Data pipeline (cluster.batch) against one offline engine, on the
same prompts, measured side by side in one run.

    python scripts/bench_batch.py [--model DIR] [--rows 512] [--concurrency 1,2] [--max-tokens 64] \
        [engine flags]

Prints generated tokens per second for the offline `LLM.generate` over all rows, then for
`run_batch` with each concurrency (engine actors). The pipeline's figure includes reading and
writing Parquet and the actors' start-up (model load), as a user's job would.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.args import EngineArgs  # noqa: E402  (after the path set-up above)

WORDS = ("the river ran quietly past a village where an engineer measures twice before she cuts "
         "once upon a time there was a small boat on the sea and the wind").split()


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 64))) for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,2", help="comma list of engine-actor counts")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--workload-seed", type=int, default=0)
    EngineArgs.add_cli_args(ap)  # --model (default: the tiny preset) and every engine flag
    args = ap.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray

    from cluster.batch import run_batch
    from cluster.default_model import ensure_preset_model
    from engine import LLM, SamplingParams

    engine_args = EngineArgs.from_cli_args(args, model=args.model or ensure_preset_model("tiny"))
    rows = prompts(args.rows, args.workload_seed)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    total = args.rows * args.max_tokens

    llm = LLM.from_engine_args(engine_args)
    llm.generate(rows[:4], sampling, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    llm.generate(rows, sampling, use_tqdm=False)
    offline = total / (time.perf_counter() - t)
    del llm
    print(f"offline LLM.generate      : {offline:8.0f} tok/s  ({args.rows} rows x {args.max_tokens} tokens)")

    ray.init(include_dashboard=False, log_to_driver=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "in.parquet")
        pq.write_table(pa.table({"prompt": rows}), src)
        for c in (int(x) for x in args.concurrency.split(",")):
            t = time.perf_counter()
            run_batch(src, os.path.join(tmp, f"out-{c}.parquet"), engine_args, concurrency=c,
                      batch_size=args.batch_size, sampling=sampling, num_cpus=max(os.cpu_count() // 2 // c, 0.25),
                      torch_threads=max(os.cpu_count() // c, 1))
            rate = total / (time.perf_counter() - t)
            print(f"run_batch concurrency={c}   : {rate:8.0f} tok/s  ({rate / offline:.2f}x offline, "
                  f"incl. Parquet I/O and actor start-up)")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
