"""`pdserve batch IN OUT`: the batch pipeline from the command line (local Ray, or the
cluster in RAY_ADDRESS)."""

from __future__ import annotations

import argparse
import os
import sys
import time


def add_batch_parser(sub) -> None:
    p = sub.add_parser("batch", help="generate for every row of a Parquet dataset (Ray Data map_batches)")
    p.add_argument("input", help="Parquet file or directory")
    p.add_argument("output", help="Parquet file (*.parquet) or directory")
    p.add_argument("--model", default=None, help="model directory (default: the embedded tiny model)")
    p.add_argument("--prompt-column", default="prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--concurrency", type=int, default=1, help="engine actors")
    p.add_argument("--batch-size", type=int, default=256,
                   help="rows per map_batches call (an engine drains at the end of each batch)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--cpus-per-actor", type=float, default=None)
    p.add_argument("--gpus-per-actor", type=float, default=None)
    p.set_defaults(fn=run_batch_cli)


def run_batch_cli(args: argparse.Namespace) -> int:
    import ray

    from cluster.batch import run_batch
    from cluster.cli import ensure_default_model
    from engine.sampling_params import SamplingParams

    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                "ignore_eos": args.ignore_eos}
    SamplingParams(**sampling)  # bad flags fail here, before Ray starts
    engine_kwargs = {"dtype": args.dtype, "max_model_len": args.max_model_len}
    if args.num_kv_blocks is not None:
        engine_kwargs["num_kv_blocks"] = args.num_kv_blocks
    model = args.model or ensure_default_model()
    address = os.environ.get("RAY_ADDRESS")
    started = not ray.is_initialized()  # a caller's Ray (tests, notebooks) is used as is
    if started:
        ray.init(address=address or None, include_dashboard=False if not address else None, log_to_driver=False)
    try:
        start = time.perf_counter()
        rows = run_batch(args.input, args.output, model, prompt_column=args.prompt_column,
                         concurrency=args.concurrency, batch_size=args.batch_size, engine_kwargs=engine_kwargs,
                         sampling=sampling, num_cpus=args.cpus_per_actor, num_gpus=args.gpus_per_actor)
        print(f"wrote {rows} rows to {args.output} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    finally:
        if started:
            ray.shutdown()
    return 0
