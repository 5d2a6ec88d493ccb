"""Batch-1 decode of quantized Hugging Face checkpoints on pdserve, beside the same model as a
Q4_K_M GGUF file (for GPTQ W4A16) and as the dense fp32 checkpoint (for compressed-tensors
W8A8), all with the same CPU threads.

One model (make_model's preset, random weights: only speed and memory mean anything) is
written five ways once: the dense fp32 safetensors directory, a GPTQ 4-bit checkpoint (group
128, symmetric, v1 format; --desc-act scatters the groups) with its head unquantized and, as
gptqmodel's lm_head=True makes it, one with the head quantized too, a compressed-tensors W8A8
one (int8 per-channel weights, dynamic per-token int8 activations), and a Q4_K_M GGUF file
(llama.cpp's own quantizer; without llama-cpp-python, gguf-py's writer with the same type
mix). The quantized checkpoints store what they leave unquantized (head, embedding, norms) in
16 bits, as real ones do: fp16 (GPTQ), bf16 (compressed-tensors). Each variant runs in a fresh subprocess per repeat, the variants alternating, and the
script prints each figure's range:
  - batch-1 decode: tokens/s of one greedy request, --tokens tokens (the prefill excluded),
    and the process's CPU time per token (with --threads 1 the figure a busy machine's
    neighbours disturb least);
  - batch 8: output tokens/s of eight greedy requests at once;
  - resident memory the model adds after loading and one warm-up request, less the KV cache.

    python scripts/bench_hf_quant.py --dir /tmp/hfq                    # the `bench` preset
    python scripts/bench_hf_quant.py --dir /tmp/hfq1b --preset 1b --repeats 3
    python scripts/bench_hf_quant.py --dir /tmp/hfqs --preset tiny --group 32 --tokens 8 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = ("gptq-w4a16", "gptq-w4a16-qhead", "gguf-q4_k_m", "ct-w8a8", "dense-fp32")
# Q4_K_M's mix as llama.cpp makes it for a Llama (attn_v and ffn_down in Q6_K), for gguf-py.
Q4_K_M_TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
                "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q4_K"}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def make_models(out: str, preset: str, group: int, desc_act: bool) -> dict[str, str]:
    """The variants' paths, written under `out` when absent."""
    import torch

    from engine.models.make_model import make_model
    from tests.engine.gguf_factory import write_gguf
    from tests.engine.hf_quant_factory import write_quantized

    os.makedirs(out, exist_ok=True)
    dense = os.path.join(out, "dense")
    if not os.path.exists(os.path.join(dense, "config.json")):
        make_model(dense, preset, "llama")
    paths = {"dense-fp32": dense, "gptq-w4a16": os.path.join(out, "gptq"),
             "gptq-w4a16-qhead": os.path.join(out, "gptq-qhead"), "ct-w8a8": os.path.join(out, "w8a8"),
             "gguf-q4_k_m": os.path.join(out, "q4_k_m.gguf")}
    for variant, lm_head in (("gptq-w4a16", False), ("gptq-w4a16-qhead", True)):
        if not os.path.exists(os.path.join(paths[variant], "config.json")):
            write_quantized(dense, paths[variant], "gptq", bits=4, group=group, sym=True, desc_act=desc_act,
                            oracle=False, dense_dtype=torch.float16, lm_head=lm_head)
    if not os.path.exists(os.path.join(paths["ct-w8a8"], "config.json")):
        write_quantized(dense, paths["ct-w8a8"], "ct", bits=8, group=-1, sym=True, oracle=False,
                        dense_dtype=torch.bfloat16)
    if not os.path.exists(paths["gguf-q4_k_m"]):
        try:
            from scripts.bench_gguf_load import quantize_q4_k_m

            f16 = write_gguf(dense, os.path.join(out, "f16.gguf"), "F16")
            quantize_q4_k_m(f16, paths["gguf-q4_k_m"])
        except ImportError:
            write_gguf(dense, paths["gguf-q4_k_m"], "Q4_K", types=Q4_K_M_TYPES)
    return paths


def run(model: str, threads: int, tokens: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from engine import LLM, SamplingParams
    from tests.engine.hf_reference import random_prompts

    base = _rss_mb()
    llm = LLM(model, max_model_len=1024, max_num_seqs=8, enable_prefix_caching=False)
    engine = llm.engine
    core = engine.core
    kv_mb = core.executor.kv_bytes_per_block() * core.num_kv_blocks / 2**20
    vocab = core.executor.worker.runner.model.arch.vocab_size
    prompts = random_prompts([32] * 9, vocab, seed=1)
    greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], greedy, use_tqdm=False)  # warm-up
    rss = _rss_mb() - kv_mb - base
    engine.add_request("b1", {"prompt_token_ids": prompts[1]}, greedy)
    engine.step()  # the prefill
    t0, c0, steps = time.perf_counter(), time.process_time(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    decode = steps / (time.perf_counter() - t0)
    cpu_ms = (time.process_time() - c0) * 1e3 / steps
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[1:9]], greedy, use_tqdm=False)
    batch8 = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
    model = core.executor.worker.runner.model
    kept = sum(1 for m in model.modules() if getattr(m, "quant", None) is not None and hasattr(m.quant, "segments"))
    return {"decode_tok_s": decode, "decode_cpu_ms": cpu_ms, "batch8_tok_s": batch8, "rss_mb": rss, "kept": kept,
            "head": _head_form(model)}


def _head_form(model) -> str:
    """How the logits' weight is held: its block types, its 16-bit dtype, or fp32."""
    q = (model.lm_head if model.lm_head is not None else model.embed_tokens).quant
    if q is None:
        return "fp32"
    if hasattr(q, "segments"):
        return "+".join(sorted({s.qtype for s in q.segments}))
    return str(q.dtype).removeprefix("torch.")


def _spawn(model: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", model, "--threads", str(args.threads),
           "--tokens", str(args.tokens)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{model} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def _span(values: list[float], fmt: str = "{:.1f}") -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", help="where the variants are written (once) and read")
    p.add_argument("--preset", default="bench", help="make_model's preset (bench, 1b, small, tiny)")
    p.add_argument("--group", type=int, default=128, help="GPTQ group size")
    p.add_argument("--desc-act", action="store_true", help="GPTQ act-order: groups scattered over the columns")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128, help="tokens decoded per request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                   help="the variants timed (all are written)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(run(args.child, args.threads, args.tokens)))
        return 0
    if not args.dir:
        p.error("--dir is required")
    paths = make_models(args.dir, args.preset, args.group, args.desc_act)
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    for _ in range(args.repeats):
        for v in args.variants:  # alternated, so every variant sees the same machine
            runs[v].append(_spawn(paths[v], args))
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    print(f"preset {args.preset}, GPTQ group {args.group}{' act-order' if args.desc_act else ''}, "
          f"{args.threads} threads, {args.tokens} tokens, {args.repeats} repeats (ranges), load {os.getloadavg()[0]:.2f}")
    print(f"CPU {cpu}")
    print("| variant | batch-1 decode tok/s | batch-1 CPU ms/token | batch 8 tok/s | resident MB | kept projections "
          "| head |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for v in args.variants:
        rs = runs[v]
        print(f"| {v} | {_span([r['decode_tok_s'] for r in rs])} | {_span([r['decode_cpu_ms'] for r in rs], '{:.2f}')} | "
              f"{_span([r['batch8_tok_s'] for r in rs])} | "
              f"{_span([r['rss_mb'] for r in rs], '{:.0f}')} | {rs[0]['kept']} | {rs[0]['head']} |")
    for a, b in (("gptq-w4a16", "gguf-q4_k_m"), ("gptq-w4a16-qhead", "gguf-q4_k_m"), ("ct-w8a8", "dense-fp32")):
        if a not in runs or b not in runs:
            continue
        r = [x["decode_tok_s"] / y["decode_tok_s"] for x, y in zip(runs[a], runs[b])]
        c = [y["decode_cpu_ms"] / x["decode_cpu_ms"] for x, y in zip(runs[a], runs[b])]
        print(f"{a} / {b} batch-1 decode: {_span(r, '{:.2f}')}x tokens/s, {_span(c, '{:.2f}')}x by CPU time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
