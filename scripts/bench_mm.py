"""The encoder cache's effect: offline requests/s on a LLaVA model when half the requests
repeat an image another request sent, against all-distinct images, side by side in one run.

Every request is "<distinct text> <image> <question>" with one image, greedy, `ignore_eos`,
the same max_tokens. The distinct text comes first so the prefix cache never covers an image's
placeholders: a repeated image can be saved only by the encoder cache, which is what this
measures. In the repeated workload each image appears twice, the two copies at random
positions of the batch (fixed seed). Every repeat draws fresh images, so nothing from an
earlier side is cached. The sides alternate (and which goes first alternates) because these
machines are noisy; the report gives the median and the spread.

    python scripts/bench_mm.py                        # makes a small LM + bench CLIP (256 image tokens)
    python scripts/bench_mm.py --model DIR --num-requests 64 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "pdserve", "bench-llava-small")


def _image(seed: int, side: int = 256):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (side, side, 3), dtype=np.uint8))


def workload(n: int, repeated: bool, seed: int) -> list[dict]:
    """n prompts; with `repeated`, n/2 images each used by two requests at random positions."""
    distinct = n // 2 if repeated else n
    images = [_image(seed * 100_000 + i) for i in range(distinct)]
    order = list(range(distinct)) * (2 if repeated else 1)
    random.Random(seed).shuffle(order)
    return [{"prompt": f"Request {i} of the benchmark: <image> What is shown?",
             "multi_modal_data": {"image": images[k]}} for i, k in enumerate(order)]


def _cpu_s() -> float:
    """This process's CPU seconds (user + system): on a shared machine, where wall time
    depends on what the neighbours run, the work itself is what this counts."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _figure(llm, name: str) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == name)


def run_side(llm, prompts: list[dict], params) -> dict:
    before = {k: _figure(llm, f"pdserve:{k}") for k in ("encoder_cache_hits", "encoder_cache_queries",
                                                       "encoder_seconds")}
    t0, c0 = time.perf_counter(), _cpu_s()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
    after = {k: _figure(llm, f"pdserve:{k}") for k in before}
    assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outs)
    return {"req_per_s": len(prompts) / wall, "wall_s": wall, "req_per_cpu_s": len(prompts) / cpu,
            "hits": after["encoder_cache_hits"] - before["encoder_cache_hits"],
            "queries": after["encoder_cache_queries"] - before["encoder_cache_queries"],
            "encoder_s": after["encoder_seconds"] - before["encoder_seconds"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a LLaVA model directory (made there, small LM + bench "
                    f"CLIP, if it holds none; default {DEFAULT_DIR})")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--encoder-cache-size", type=int, default=None)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = ap.parse_args(argv)
    import torch

    from engine.llm import LLM
    from engine.models.make_llava import make_llava
    from engine.sampling_params import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or DEFAULT_DIR
    if not os.path.isfile(os.path.join(model, "config.json")):
        make_llava(model, "small", vision_preset="bench")
    llm = LLM(model, max_model_len=512)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    run_side(llm, workload(4, False, seed=999), params)  # warm-up
    sides: dict[str, list[dict]] = {"distinct": [], "50% repeated": []}
    for r in range(args.repeats):
        names = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for name in names:
            prompts = workload(args.num_requests, name != "distinct", seed=2 * r + (name != "distinct"))
            sides[name].append(run_side(llm, prompts, params))
    print(f"model {model}  requests {args.num_requests}  max_tokens {args.max_tokens}  "
          f"repeats {args.repeats}  torch threads {torch.get_num_threads()}")
    print(f"{'workload':<14} {'req/s (median)':>15} {'min..max':>14} {'req/CPU-s':>10} {'encoded':>8} "
          f"{'hits':>6} {'encoder s':>10}")
    medians, per_cpu = {}, {}
    for name, runs in sides.items():
        rates = [x["req_per_s"] for x in runs]
        medians[name] = statistics.median(rates)
        per_cpu[name] = statistics.median(x["req_per_cpu_s"] for x in runs)
        last = runs[-1]
        print(f"{name:<14} {medians[name]:>15.2f} {min(rates):>6.2f}..{max(rates):<6.2f} {per_cpu[name]:>10.2f} "
              f"{last['queries'] - last['hits']:>8.0f} {last['hits']:>6.0f} {last['encoder_s']:>10.2f}")
    print(f"encoder cache speed-up: {medians['50% repeated'] / medians['distinct']:.2f}x wall, "
          f"{per_cpu['50% repeated'] / per_cpu['distinct']:.2f}x per CPU second")
    if args.json:
        print(json.dumps(sides))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
