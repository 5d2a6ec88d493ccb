"""Time kernels.cpu.quant.quant_matmul (GGUF blocks kept quantized) against fp32 products on the
dequantized weight: torch's F.linear (MKL) and oneDNN with the weight packed once
(engine.models.cpu_linear), and against the weight held in fp16 (kernels.cpu.half, a quantized
checkpoint's unquantized head), for the linear shapes of SmolLM2-135M and of a 1B llama.

    python scripts/bench_quant_kernels.py --threads 2
    python scripts/bench_quant_kernels.py --threads 1 --types Q4_0 Q4_K --rows 1 8
    python scripts/bench_quant_kernels.py --threads 1 --clock cpu --stat min   # a shared machine

Per (type, shape, T): microseconds per call (median, or with --stat min the minimum, of
--repeats samples, each a loop of calls lasting about --sample-ms), and the weight bytes read per second (GB/s, the
quantized row bytes for quant_matmul, 4 bytes per value for the fp32 products). With
--rotate-mb, each call uses the next of enough weight copies to fill that many MB, so the
weights come from memory rather than from cache. A shape whose K is not a whole number of the
type's blocks (K-quants need K % 256 == 0: 576) is left out, as llama.cpp leaves such
tensors to another type. --clock cpu times with the process's CPU time (time.process_time)
instead of the wall clock: with one thread on a machine others keep busy, the time the
process waits for a core is then left out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.models import cpu_linear  # noqa: E402
from engine.models.gguf_quants import dequantize  # noqa: E402
from kernels.cpu import build, half, quant  # noqa: E402

# (name, N out, K in)
SHAPES = [
    ("135M q/o", 576, 576), ("135M k/v", 192, 576), ("135M gate/up", 1536, 576),
    ("135M down", 576, 1536), ("135M head", 49152, 576),
    ("1B q/o", 2048, 2048), ("1B gate/up", 5632, 2048), ("1B down", 2048, 5632), ("1B head", 32000, 2048),
]
# Byte offsets of each block's fp16 fields (gguf's block structs).
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_qweight(qtype: str, N: int, K: int, rng: np.random.Generator) -> torch.Tensor:
    """Random integer fields with small finite fp16 scales: uint8 [N, row bytes]."""
    _, values, nbytes = quant.QTYPES[qtype]
    blocks = rng.integers(0, 256, (N * K // values, nbytes), dtype=np.uint8)
    for start in FP16_FIELDS[qtype]:
        blocks[:, start:start + 2] = rng.uniform(1e-3, 2e-3, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(blocks.reshape(N, -1))


def timed(fn, repeats: int, sample_ms: float, stat: str = "median", clock=time.perf_counter) -> float:
    """Seconds per call: the median (or minimum) over `repeats` samples, each a loop of calls
    lasting about sample_ms. On a busy machine the minimum is the less noisy of the two."""
    fn()
    start, calls = clock(), 0
    while clock() - start < sample_ms / 1e3 or calls < 2:
        fn()
        calls += 1
    inner = max(1, int(calls * sample_ms / 1e3 / max(clock() - start, 1e-9)))
    samples = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(inner):
            fn()
        samples.append((clock() - t0) / inner)
    return min(samples) if stat == "min" else statistics.median(samples)


def cycler(items: list):
    state = {"i": -1}

    def next_item():
        state["i"] = (state["i"] + 1) % len(items)
        return items[state["i"]]
    return next_item


def bench(qtype: str, N: int, K: int, T: int, args, rng) -> dict[str, float]:
    qw = random_qweight(qtype, N, K, rng)
    copies = max(1, int(args.rotate_mb * 2**20 // qw.numel())) if args.rotate_mb else 1
    qws = cycler([qw] + [qw.clone() for _ in range(copies - 1)])
    x = torch.randn(T, K)
    out = torch.empty(T, N)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    res, timing = {}, (args.repeats, args.sample_ms, args.stat, clock)
    for method in ("int8", "fp32"):
        sec = timed(lambda m=method: quant.quant_matmul(x, qws(), qtype, K, out, method=m), *timing)
        res[method] = sec
    if not args.no_fp32_baselines:
        W = dequantize(qw.reshape(-1), qtype, (N, K)).contiguous()
        fcopies = max(1, int(args.rotate_mb * 2**20 // (W.numel() * 4))) if args.rotate_mb else 1
        Ws = cycler([W] + [W.clone() for _ in range(fcopies - 1)])
        res["F.linear"] = timed(lambda: torch.nn.functional.linear(x, Ws()), *timing)
        halves = cycler([w.half() for w in [W] * fcopies])
        res["fp16"] = timed(lambda: half.half_matmul(x, halves(), out), *timing)
        if cpu_linear.onednn_linear_available():
            packed = cycler([cpu_linear.pack_weight(W) for _ in range(fcopies)])
            res["oneDNN"] = timed(lambda: cpu_linear.packed_linear(x, packed(), None), *timing)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--types", nargs="+", default=["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32], help="activation rows T")
    p.add_argument("--shapes", nargs="+", help="names from SHAPES (default: all)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--sample-ms", type=float, default=30.0)
    p.add_argument("--stat", choices=["median", "min"], default="median", help="of the samples")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall: time.perf_counter; cpu: time.process_time (all threads' CPU time)")
    p.add_argument("--rotate-mb", type=float, default=0.0, help="cycle weight copies filling this many MB")
    p.add_argument("--no-fp32-baselines", action="store_true", help="nor the fp16 product")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not quant.supported("Q4_0", 32):
        sys.exit("the native CPU kernels are not available")
    rng = np.random.default_rng(0)
    shapes = [s for s in SHAPES if not args.shapes or s[0] in args.shapes]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"{time.strftime('%Y-%m-%d')} {cpu}, {os.cpu_count()} CPUs, kernels' ISA level {build.isa_level()} "
          f"(set {build.ENV} to force one); threads={args.threads} "
          f"rotate_mb={args.rotate_mb} torch={torch.__version__}; us per call ({args.clock} clock), "
          f"{args.stat} of {args.repeats}")
    head = (f"{'type':5} {'shape':13} {'N x K':>11} {'T':>3} | {'int8 us':>8} {'GB/s':>5} | {'fp32 us':>8} "
            f"{'GB/s':>5} | {'F.linear':>8} {'oneDNN':>8} {'fp16':>8} | best vs fp32 weight")
    print(head)
    print("-" * len(head))
    for qtype in args.types:
        for name, N, K in shapes:
            if not quant.supported(qtype, K):
                continue
            for T in args.rows:
                r = bench(qtype, N, K, T, args, rng)
                nbytes = N * quant.row_bytes(qtype, K)
                ours = min(r["int8"], r["fp32"])
                base = [r[k] for k in ("F.linear", "oneDNN") if k in r]
                speedup = f"{min(base) / ours:5.2f}x" if base else "-"
                print(f"{qtype:5} {name:13} {N:>5}x{K:<5} {T:>3} | {r['int8'] * 1e6:8.1f} {nbytes / r['int8'] / 1e9:5.1f} "
                      f"| {r['fp32'] * 1e6:8.1f} {nbytes / r['fp32'] / 1e9:5.1f} | "
                      f"{r.get('F.linear', float('nan')) * 1e6:8.1f} {r.get('oneDNN', float('nan')) * 1e6:8.1f} "
                      f"{r.get('fp16', float('nan')) * 1e6:8.1f} | {speedup}",
                      flush=True)


if __name__ == "__main__":
    main()
