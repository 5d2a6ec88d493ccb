"""`pdserve batch IN OUT`: the batch pipeline from the command line (local Ray, or the
cluster in RAY_ADDRESS)."""

from __future__ import annotations

import argparse
import sys
import time

from cluster.launch.sampling_flags import add_sampling_args, sampling_params
from engine.args import EngineArgs


def add_batch_parser(sub) -> None:
    p = sub.add_parser("batch", help="generate for every row of a Parquet dataset (Ray Data map_batches)")
    p.add_argument("input", help="Parquet file or directory")
    p.add_argument("output", help="Parquet file (*.parquet) or directory")
    p.add_argument("--prompt-column", default="prompt")
    p.add_argument("--concurrency", type=int, default=1, help="engine actors")
    p.add_argument("--batch-size", type=int, default=256,
                   help="rows per map_batches call (an engine drains at the end of each batch)")
    p.add_argument("--cpus-per-actor", type=float, default=None)
    p.add_argument("--gpus-per-actor", type=float, default=None)
    add_sampling_args(p)
    EngineArgs.add_cli_args(p)  # --model (default: SmolLM2-135M-Instruct) and every engine flag
    p.set_defaults(fn=run_batch_cli)


def run_batch_cli(args: argparse.Namespace) -> int:
    import ray

    from cluster.batch.pipeline import run_batch
    from engine.models.default_model import default_model

    sampling = sampling_params(args)  # bad flags fail here, before Ray starts
    engine_args = EngineArgs.from_cli_args(args, model=args.model or default_model())
    engine_args.create_engine_config()
    started = not ray.is_initialized()  # a caller's Ray (tests, notebooks) is used as is
    if started:
        import os

        from cluster.batch.pipeline import LOCAL_RAY_ENV
        from cluster.launch.ray_connect import connect

        for k, v in LOCAL_RAY_ENV.items():
            os.environ.setdefault(k, v)
        connect(log_to_driver=False)  # bounded; RAY_ADDRESS, token auth, dead recorded clusters
    try:
        start = time.perf_counter()
        rows = run_batch(args.input, args.output, engine_args, prompt_column=args.prompt_column,
                         concurrency=args.concurrency, batch_size=args.batch_size, sampling=sampling,
                         num_cpus=args.cpus_per_actor, num_gpus=args.gpus_per_actor)
        print(f"wrote {rows} rows to {args.output} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    finally:
        if started:
            ray.shutdown()
    return 0
