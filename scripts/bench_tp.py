"""Tensor parallel: throughput and mean step time of the same requests at each
--tensor-parallel-size, side by side in one run (these machines are noisy).

    python scripts/bench_tp.py                       # CPU, small preset (made on first use), TP 1 and 2
    python scripts/bench_tp.py --model DIR --tp 1 2 4 --num-requests 64
    python scripts/bench_tp.py --backend mp ray      # both executors side by side (ray: local Ray)

On a CPU the ranks share the same cores (each gets cores / tp threads), so expect no gain:
the figure shows what the all-reduces and the per-step hop to the ranks (a pipe for "mp", an
actor call with the step in the object store for "ray") cost.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(model: str, tp: int, backend: str, reqs: list[tuple[list[int], int]], max_num_seqs: int) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=tp, distributed_executor_backend=None if tp == 1 else backend,
              max_model_len=1024, max_num_seqs=max_num_seqs)
    try:
        core = llm.engine.core
        steps = 0
        real_step = core.step

        def counting_step():
            nonlocal steps
            steps += 1
            return real_step()

        core.step = counting_step
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tp": tp, "backend": backend if tp > 1 else "uni", "output_tok_s": tokens / elapsed, "step_ms": 1000 * elapsed / steps, "steps": steps,
            "seconds": elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir (default: the small preset, made on first use)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--backend", nargs="+", default=["mp"], choices=["mp", "ray"],
                    help="executor(s) of the tp > 1 runs")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 128))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 64))
    ap.add_argument("--max-num-seqs", type=int, default=32)
    args = ap.parse_args()
    model = args.model
    if model is None:
        from engine.models.make_model import make_model

        model = os.path.join(os.environ.get("PDSERVE_CACHE", os.path.expanduser("~/.cache/pdserve")), "small-llama")
        if not os.path.isfile(os.path.join(model, "config.json")):
            make_model(model, "small", "llama")
    rng = random.Random(0)
    reqs = [([rng.randrange(3, 1000) for _ in range(rng.randint(*args.prompt_len))], rng.randint(*args.output_len))
            for _ in range(args.num_requests)]
    if "ray" in args.backend:
        import ray

        import actors.ray_executor  # noqa: F401  (registers distributed_executor_backend="ray")

        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    print(f"model={model} requests={len(reqs)} cores={os.cpu_count()}")
    print(f"{'tp':>3} {'backend':>8} {'output tok/s':>13} {'ms/step':>8} {'steps':>6} {'s':>7}")
    runs = [(tp, backend) for tp in args.tp for backend in (args.backend if tp > 1 else ["uni"])]
    for tp, backend in runs:
        r = measure(model, tp, backend, reqs, args.max_num_seqs)
        print(f"{r['tp']:>3} {r['backend']:>8} {r['output_tok_s']:>13.1f} {r['step_ms']:>8.2f} {r['steps']:>6} "
              f"{r['seconds']:>7.2f}")


if __name__ == "__main__":
    main()
