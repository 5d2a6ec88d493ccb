"""What recording KV events costs an engine: the same offline batch with events on and off,
alternating, side by side in one run (docs/kv_cache.md#kv-events).

    python scripts/bench_kv_events.py [--model DIR] [--prompts 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import LLM, SamplingParams  # noqa: E402  (after the path set-up above)
from engine.models.default_model import default_model  # noqa: E402
from kernels.cpu.build import level_in_use  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prefix-tokens", type=int, default=256, help="shared by groups of 4 prompts")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    model = args.model or default_model()
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    print(f"CPU {cpu}, {os.cpu_count()} cores; CPU kernels: ISA level {level_in_use()}")
    rng = random.Random(0)
    prefixes = [[rng.randrange(100, 20000) for _ in range(args.prefix_tokens)] for _ in range(args.prompts // 4)]
    prompts = [{"prompt_token_ids": prefixes[i // 4] + [rng.randrange(100, 20000) for _ in range(32)]}
               for i in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llms = {on: LLM(model, kv_events_config={"enable_kv_cache_events": on}) for on in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for on, llm in llms.items():
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times[on].append(time.perf_counter() - t0)
    for on in (False, True):
        print(f"events {'on ' if on else 'off'}: " + ", ".join(f"{t:.2f} s" for t in times[on]))
    print(f"on / off, best of {args.repeats}: {min(times[True]) / min(times[False]):.3f}")
    batches = llms[True].engine.core.kv_events.log.seq
    print(f"event batches recorded: {batches}")


if __name__ == "__main__":
    main()
