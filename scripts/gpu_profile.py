"""Where a GPU decode step goes: the kernels of one step at batch 1 and 64 on the `1b` preset
(or --model), eager, from torch's profiler, with launches per step and GPU microseconds per
step for each kernel, and the step's wall time with and without CUDA graphs beside. This is
the list the kernel-fusion work reads (docs/benchmarks.md#where-a-decode-step-goes). Needs CUDA.

    python scripts/gpu_profile.py [--model DIR] [--batches 1 64] [--steps 8] [--top 25]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _engine(model: str, batch: int, eager: bool, vocab: int, prompt_len: int):
    from engine import SamplingParams
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineArgs(model, enable_prefix_caching=False, enforce_eager=eager,
                               max_num_seqs=batch).create_engine_config())
    rng = random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)  # more than warm-up and timed steps
    for i in range(batch):
        eng.add_request(f"p{i}", {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt_len)]},
                        params)
    eng.step()  # the prefill
    for _ in range(3):  # warm-up: allocator, Triton compiles, graph capture
        eng.step()
    torch.cuda.synchronize()
    return eng


def _step_ms(eng, steps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def profile_batch(model: str, batch: int, steps: int, top: int, vocab: int, prompt_len: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    graphs = _engine(model, batch, False, vocab, prompt_len)
    graph_ms = _step_ms(graphs, steps)
    del graphs
    gc.collect()
    torch.cuda.empty_cache()
    eng = _engine(model, batch, True, vocab, prompt_len)
    eager_ms = _step_ms(eng, steps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = per_kernel[ev.name[:90]]
            k[0] += 1
            k[1] += ev.device_time or ev.self_cpu_time_total  # the CPU check of this script has no device time
    total_us = max(sum(us for _, us in per_kernel.values()) / steps, 1e-9)
    launches = sum(n for n, _ in per_kernel.values()) / steps
    print(f"\nbatch {batch}, context ~{prompt_len}: step {graph_ms:.3f} ms with CUDA graphs, {eager_ms:.3f} ms "
          f"eager; kernels {launches:.0f} launches and {total_us:.0f} us of GPU time per step")
    print(f"{'us/step':>9} {'share':>6} {'n/step':>7}  kernel")
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])
    for name, (n, us) in ranked[:top]:
        print(f"{us / steps:9.1f} {100 * us / steps / total_us:5.1f}% {n / steps:7.1f}  {name}")
    del eng
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir or .gguf file (default: the 1b preset)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--prompt-len", type=int, default=256)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_profile.py needs a CUDA GPU")
    from engine.models.arch import load_arch
    from engine.models.default_model import ensure_preset_model

    model = args.model or ensure_preset_model("1b")
    vocab = min(load_arch(model).vocab_size, 1400)
    print(f"device: {torch.cuda.get_device_name()}, model {model}")
    for batch in args.batches:
        profile_batch(model, batch, args.steps, args.top, vocab, args.prompt_len)


if __name__ == "__main__":
    main()
