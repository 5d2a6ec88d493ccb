"""Batch throughput: the Ray Data pipeline (cluster.batch.pipeline) against the offline engine, on the
same rows, same engine args and same torch threads, measured side by side in one run.

    python scripts/bench_batch.py [--model DIR] [--rows 1024] [--max-tokens 64] [--repeat 3] \
        [--concurrency 1] [--batch-size 256] [--torch-threads N] [--worker-niceness 0] [engine flags]

Each repetition runs the offline `LLM.generate` over all rows in this process, then `run_batch`
over the same rows (Parquet in, Parquet out), and prints generated tokens per second of both:
- `steady`: the pipeline from the moment its engine actor has loaded the model to the job's end
  (what a long job tends to);
- `total`: from the `run_batch` call, Ray Data's start, the actor's start and model load and
  the Parquet I/O included (what this job's user waits);
and the start-up seconds. Torch threads default to one batch actor's (its CPU reservation, see
`cluster.batch.pipeline.fit_actors`); the offline engine gets the same number. Ray's workers run at this
process's niceness (`cluster.batch.pipeline.LOCAL_RAY_ENV`, as under `pdserve batch`) unless
`--worker-niceness` says otherwise (Ray's own default is 15). The last lines give min / median
/ max of each ratio over the repetitions, with the load average (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster.batch.pipeline import EnginePredictor  # noqa: E402  (after the path set-up above)
from engine.args import EngineArgs  # noqa: E402

WORDS = ("the river ran quietly past a village where an engineer measures twice before she cuts "
         "once upon a time there was a small boat on the sea and the wind").split()


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 64))) for _ in range(n)]


class TimedPredictor(EnginePredictor):
    """EnginePredictor that appends when its engine was ready (wall clock) to `log_path`
    (a class attribute: the class travels to the actor by value, with it)."""

    log_path = ""

    def __init__(self, *args, **kwargs) -> None:
        start = time.time()
        super().__init__(*args, **kwargs)
        import torch

        with open(self.log_path, "a") as f:
            f.write(json.dumps({"start": start, "ready": time.time(), "threads": torch.get_num_threads(),
                                "pid": os.getpid(), "nice": os.nice(0)}) + "\n")


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def spread(xs: list[float]) -> str:
    return f"min {min(xs):.2f} / median {statistics.median(xs):.2f} / max {max(xs):.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--concurrency", default="1", help="comma list of engine-actor counts")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch threads of the offline engine and of each actor (default: one actor's CPUs)")
    ap.add_argument("--worker-niceness", type=int, default=None,
                    help="Ray workers' niceness relative to this process (default: pdserve batch's, 0)")
    ap.add_argument("--workload-seed", type=int, default=0)
    EngineArgs.add_cli_args(ap)  # --model (default: the tiny preset) and every engine flag
    args = ap.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray
    import torch

    from cluster.batch.pipeline import LOCAL_RAY_ENV, fit_actors, run_batch
    from engine import LLM, SamplingParams
    from engine.models.default_model import ensure_preset_model

    engine_args = EngineArgs.from_cli_args(args, model=args.model or ensure_preset_model("tiny"))
    rows = prompts(args.rows, args.workload_seed)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    total = args.rows * args.max_tokens
    threads = args.torch_threads or max(1, int(fit_actors(1, None, 0, {"CPU": float(os.cpu_count())})))
    torch.set_num_threads(threads)
    os.environ.update(LOCAL_RAY_ENV)
    if args.worker_niceness is not None:
        os.environ["RAY_worker_niceness"] = str(args.worker_niceness)
    print(f"{args.rows} rows x {args.max_tokens} tokens (EOS ignored), model {engine_args.model}, "
          f"{threads} torch thread(s), {os.cpu_count()} CPUs, niceness {os.nice(0)}, Ray workers "
          f"+{os.environ['RAY_worker_niceness']}", flush=True)

    ray.init(include_dashboard=False, log_to_driver=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ratios: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "in.parquet")
        pq.write_table(pa.table({"prompt": rows}), src)
        TimedPredictor.log_path = os.path.join(tmp, "actors.jsonl")
        for rep in range(1, args.repeat + 1):
            load_before = load()
            llm = LLM.from_engine_args(engine_args)
            llm.generate(rows[:4], sampling, use_tqdm=False)  # warm-up
            t = time.perf_counter()
            llm.generate(rows, sampling, use_tqdm=False)
            offline = total / (time.perf_counter() - t)
            llm.shutdown()
            del llm
            print(f"[{rep}] offline LLM.generate   : {offline:7.0f} tok/s", flush=True)
            for c in (int(x) for x in args.concurrency.split(",")):
                if os.path.exists(TimedPredictor.log_path):
                    os.remove(TimedPredictor.log_path)
                start = time.time()
                run_batch(src, os.path.join(tmp, f"out-{c}.parquet"), engine_args, concurrency=c,
                          batch_size=args.batch_size, sampling=sampling, torch_threads=args.torch_threads,
                          predictor=TimedPredictor)
                end = time.time()
                with open(TimedPredictor.log_path) as f:
                    actors = [json.loads(line) for line in f]
                ready = min(a["ready"] for a in actors)
                steady, whole = total / (end - ready), total / (end - start)
                ratios.setdefault(f"c={c} steady", []).append(steady / offline)
                ratios.setdefault(f"c={c} total", []).append(whole / offline)
                print(f"[{rep}] run_batch concurrency={c}: steady {steady:7.0f} tok/s ({steady / offline:.2f}x) | "
                      f"total {whole:7.0f} tok/s ({whole / offline:.2f}x) | start-up {ready - start:.1f} s "
                      f"(model load {max(a['ready'] - a['start'] for a in actors):.1f} s) | actor threads "
                      f"{actors[0]['threads']}, nice {actors[0]['nice']}", flush=True)
            print(f"[{rep}] load average {load_before} -> {load()}", flush=True)
    ray.shutdown()
    for name, xs in ratios.items():
        print(f"batch/offline {name:12}: {spread(xs)} over {len(xs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
