"""Data parallelism: output throughput of the same requests on one engine core and on
--data-parallel-size cores (with and without expert parallelism), side by side in one run
(these machines are noisy). The default model is the `small` Qwen3-MoE preset (8 experts,
top-2), made on first use; the cores are processes ("mp" backend).

    python scripts/bench_dp.py                        # DP 1 vs DP 2, expert parallel off and on
    python scripts/bench_dp.py --family mixtral --num-requests 64
    python scripts/bench_dp.py --model DIR --dp 1 2 4 --gpu   # one GPU per core (CUDA)

On a CPU the cores share the machine's cores (each gets cores / dp threads), so expect no gain
on 2 cores: the figure shows what the cores' independence (or, under expert parallelism, the
token exchange every MoE layer and the dummy steps of an idle core) costs against one engine.
Every run's greedy tokens are checked against the first run's.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(model: str, dp: int, ep: bool, reqs: list[tuple[list[int], int]], args) -> tuple[dict, list]:
    from engine import LLM, SamplingParams

    llm = LLM(model, data_parallel_size=dp, enable_expert_parallel=ep, max_model_len=1024,
              max_num_seqs=args.max_num_seqs, device="cuda" if args.gpu else "cpu")
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
        llm.generate([{"prompt_token_ids": reqs[0][0]}], SamplingParams(max_tokens=2), use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        cores = llm.engine.core.load().data_parallel
    finally:
        llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"dp": dp, "ep": ep, "output_tok_s": sum(map(len, tokens)) / elapsed, "seconds": elapsed,
            "requests": [c.requests for c in cores], "dummy": [c.dummy_steps for c in cores]}, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir (default: the small preset of --family)")
    ap.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "mixtral"])
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 128))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 64))
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1, help="rounds of the whole comparison")
    ap.add_argument("--gpu", action="store_true", help="cores on CUDA GPUs (one per core)")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from engine.models.make_model import make_model

        model = os.path.join(os.environ.get("PDSERVE_CACHE", os.path.expanduser("~/.cache/pdserve")),
                             f"small-{args.family}")
        if not os.path.isfile(os.path.join(model, "config.json")):
            make_model(model, "small", args.family)
    rng = random.Random(0)
    reqs = [([rng.randrange(3, 1000) for _ in range(rng.randint(*args.prompt_len))], rng.randint(*args.output_len))
            for _ in range(args.num_requests)]
    print(f"model={model} requests={len(reqs)} output tokens={sum(n for _, n in reqs)} cores={os.cpu_count()}")
    print(f"{'round':>5} {'dp':>3} {'ep':>3} {'output tok/s':>13} {'vs dp1':>7} {'s':>7}  requests per core / dummy steps")
    runs = [(dp, ep) for dp in args.dp for ep in ((False,) if dp == 1 else (False, True))]
    for round_ in range(args.repeats):
        first_tokens, base = None, None
        for dp, ep in runs:
            r, tokens = measure(model, dp, ep, reqs, args)
            if first_tokens is None:
                first_tokens, base = tokens, r["output_tok_s"]
            assert tokens == first_tokens, f"dp={dp} ep={ep} gave other tokens than the first run"
            print(f"{round_:>5} {dp:>3} {'on' if ep else 'off':>3} {r['output_tok_s']:>13.1f} "
                  f"{r['output_tok_s'] / base:>6.2f}x {r['seconds']:>7.2f}  {r['requests']} / {r['dummy']}", flush=True)


if __name__ == "__main__":
    main()
