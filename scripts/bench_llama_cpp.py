"""pdserve next to llama.cpp (llama-cpp-python) on the same GGUF file and the same CPU threads.

Each side runs in a fresh subprocess per repeat (so resident memory is its own), sides
alternating, and the script prints each figure's range and the ratios:
  - batch-1 decode: tokens/s of one greedy request, 128 tokens after a chat prompt (the
    prefill excluded: llama.cpp's eval of the prompt, our engine's first step);
  - batch 8 and 32 (pdserve): output tokens/s of that many greedy requests at once (llama.cpp's
    Python binding runs one sequence: docs/benchmarks.md compares these with its batch-1 figure);
  - prefill of a 512-token prompt: seconds to the first token;
  - resident memory the model adds: after loading and one warm-up request, less what the
    process held before loading (imports); on our side the KV cache's size is subtracted too.

    python scripts/bench_llama_cpp.py                         # the default model (SmolLM2 Q4_1)
    python scripts/bench_llama_cpp.py --model x.gguf --threads 2 --repeats 3
    python scripts/bench_llama_cpp.py --quantization none     # pdserve's dequantized path
    python scripts/bench_llama_cpp.py --make-1b /tmp/q1b      # a 1B-shaped Q4_K_M file (below)
    PDSERVE_CPU_ISA=avx2 python scripts/bench_llama_cpp.py    # pdserve's kernels at one ISA level

The first line printed names the CPU, the ISA level of pdserve's kernels and the instruction
sets llama.cpp's CPU backend was built with.

--make-1b DIR benchmarks a 1.1B-parameter Llama shape (make_model's `1b` preset, TinyLlama's
dimensions; random weights, so only speed and memory mean anything) quantized to Q4_K_M by
llama.cpp's own quantizer. It writes DIR/1b (the HF directory, 4.4 GB fp32), DIR/1b-f16.gguf
and DIR/1b-Q4_K_M.gguf once and reuses them after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DECODE_TOKENS = 128
PREFILL_TOKENS = 512
QUESTION = "Write a long story about a lighthouse keeper who finds a map in a bottle."


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _prompts(tokenizer, n: int) -> list[list[int]]:
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": f"{QUESTION} Part {i + 1}."}],
                                           add_generation_prompt=True, tokenize=False) for i in range(n)]
    return [tokenizer.encode(c, add_special_tokens=False) for c in chats]


def _long_prompt(tokenizer) -> list[int]:
    ids = tokenizer.encode(" ".join([QUESTION] * 200))
    return ids[:PREFILL_TOKENS]


def run_pdserve(model: str, threads: int, quantization: str | None, prompts: list[list[int]],
                long: list[int]) -> dict:
    import torch

    torch.set_num_threads(threads)
    from engine import LLM, SamplingParams

    base = _rss_mb()
    # No prefix cache: llama.cpp's binding keeps none across requests either.
    llm = LLM(model, max_model_len=2048, max_num_seqs=32, quantization=quantization,
              enable_prefix_caching=False)
    engine = llm.engine
    core = engine.core
    kv_mb = core.executor.kv_bytes_per_block() * core.num_kv_blocks / 2**20
    greedy = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], greedy, use_tqdm=False)  # warm-up
    rss = _rss_mb() - kv_mb - base
    # Batch 1, step by step: the first step is the prefill, the rest decode one token each.
    engine.add_request("b1", {"prompt_token_ids": prompts[1]}, greedy)
    engine.step()
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    decode = steps / (time.perf_counter() - t0)
    batch = {}
    for n in (8, 32):
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:n]], greedy, use_tqdm=False)
        batch[n] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([{"prompt_token_ids": long}], one, use_tqdm=False)  # warm the shapes
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": long}], one, use_tqdm=False)
    prefill = time.perf_counter() - t0
    from kernels.cpu.build import isa_level

    return {"decode_tok_s": decode, "batch8_tok_s": batch[8], "batch32_tok_s": batch[32],
            "prefill_s": prefill, "rss_mb": rss, "isa": isa_level()}


def run_llama_cpp(model: str, threads: int, prompts: list[list[int]], long: list[int]) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    base = _rss_mb()
    llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)

    def decode(prompt: list[int]) -> float:
        llm.reset()
        llm.eval(prompt)
        t0 = time.perf_counter()
        for _ in range(DECODE_TOKENS - 1):
            token = llm.sample(top_k=1, temp=0.0)
            llm.eval([token])
        return (DECODE_TOKENS - 1) / (time.perf_counter() - t0)

    decode(prompts[0])  # warm-up
    rss = _rss_mb() - base
    tok_s = decode(prompts[1])
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(long)
    prefill = time.perf_counter() - t0
    # The instruction sets its CPU backend was built with ("AVX2 = 1 | ..."), for the comparison.
    features = llama_cpp.llama_print_system_info().decode().strip(" |")
    return {"decode_tok_s": tok_s, "prefill_s": prefill, "rss_mb": rss, "isa": features}


def _child(args) -> int:
    with open(args.prompts) as f:
        prompts = json.load(f)
    out = (run_llama_cpp(args.model, args.threads, prompts["chat"], prompts["long"]) if args.side == "llama_cpp"
           else run_pdserve(args.model, args.threads, args.quantization, prompts["chat"], prompts["long"]))
    print("RESULT " + json.dumps(out))
    return 0


def _spawn(args, side: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--model", args.model,
           "--threads", str(args.threads), "--prompts", args.prompts]
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{side} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def build_env() -> str:
    from kernels.cpu.build import ENV

    return f"forced by {ENV}" if os.environ.get(ENV) else f"this CPU's best; {ENV} forces one"


def _span(values: list[float], fmt: str = "{:.1f}") -> str:
    return fmt.format(min(values)) if len(values) == 1 else f"{fmt.format(min(values))}-{fmt.format(max(values))}"


def make_1b(out: str) -> str:
    """DIR/1b-Q4_K_M.gguf, made if absent: random `1b` weights -> F16 GGUF -> llama.cpp Q4_K_M."""
    target = os.path.join(out, "1b-Q4_K_M.gguf")
    if os.path.exists(target):
        return target
    from engine.models.make_model import make_model
    from scripts.bench_gguf_load import quantize_q4_k_m
    from tests.engine.gguf_factory import write_gguf

    os.makedirs(out, exist_ok=True)
    hf = os.path.join(out, "1b")
    if not os.path.exists(os.path.join(hf, "config.json")):
        make_model(hf, "1b", "llama")
    f16 = write_gguf(hf, os.path.join(out, "1b-f16.gguf"), "F16", general_name="random 1b")
    quantize_q4_k_m(f16, target + ".tmp")
    os.replace(target + ".tmp", target)
    return target


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the default model's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quantization", default=None, help="pdserve's quantization argument")
    p.add_argument("--make-1b", metavar="DIR", help="benchmark a 1B-shaped Q4_K_M file made (once) in DIR")
    p.add_argument("--side", choices=("llama_cpp", "pdserve"), help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.make_1b and not args.side:
        args.model = make_1b(args.make_1b)
    if args.model is None:
        from engine.models.default_model import default_model

        args.model = default_model()
    if args.side:
        return _child(args)
    # The same token ids for both sides, made here with the file's own tokenizer and template.
    from engine.models.gguf_tokenizer import load_gguf_tokenizer

    tok = load_gguf_tokenizer(args.model)
    args.prompts = os.path.join(tempfile.mkdtemp(), "prompts.json")
    with open(args.prompts, "w") as f:
        json.dump({"chat": _prompts(tok, 32), "long": _long_prompt(tok)}, f)
    runs = {"llama_cpp": [], "pdserve": []}
    for _ in range(args.repeats):
        for side in runs:  # alternated, so both see the same machine
            runs[side].append(_spawn(args, side))
    ours, theirs = runs["pdserve"], runs["llama_cpp"]
    col = lambda rs, k: [r[k] for r in rs]  # noqa: E731
    ratio = [o["decode_tok_s"] / t["decode_tok_s"] for o, t in zip(ours, theirs)]
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    print(f"model {os.path.basename(args.model)}, {args.threads} threads, {args.repeats} repeats "
          f"(ranges), quantization={args.quantization or 'default'}")
    print(f"CPU {cpu}; pdserve's kernels: ISA level {ours[0]['isa']} ({build_env()}); "
          f"llama.cpp: {theirs[0]['isa']}")
    print("| figure | llama.cpp | pdserve | pdserve / llama.cpp |")
    print("| --- | --- | --- | --- |")
    print(f"| batch-1 decode tok/s | {_span(col(theirs, 'decode_tok_s'))} | {_span(col(ours, 'decode_tok_s'))} "
          f"| {_span(ratio, '{:.2f}')}x |")
    for n in (8, 32):
        r = [o[f"batch{n}_tok_s"] / t["decode_tok_s"] for o, t in zip(ours, theirs)]
        print(f"| batch {n} tok/s (llama.cpp: batch 1) | {_span(col(theirs, 'decode_tok_s'))} | "
              f"{_span(col(ours, f'batch{n}_tok_s'))} | {_span(r, '{:.2f}')}x |")
    r = [t["prefill_s"] / o["prefill_s"] for o, t in zip(ours, theirs)]
    print(f"| prefill {PREFILL_TOKENS} tokens s | {_span(col(theirs, 'prefill_s'), '{:.3f}')} | "
          f"{_span(col(ours, 'prefill_s'), '{:.3f}')} | {_span(r, '{:.2f}')}x speed |")
    size = os.path.getsize(args.model) / 2**20
    print(f"| resident MB after load (file {size:.0f} MB) | {_span(col(theirs, 'rss_mb'), '{:.0f}')} | "
          f"{_span(col(ours, 'rss_mb'), '{:.0f}')} | ours / file {_span([o['rss_mb'] / size for o in ours], '{:.2f}')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
