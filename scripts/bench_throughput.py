"""Offline throughput: the pdserve engine vs Hugging Face `generate` on the same model and
the same requests, measured side by side in one run (these machines are noisy).

CPU mode (default): HF runs batches of --hf-batch-size left-padded prompts, each batch
generating up to its longest requested output (EOS ignored); useful output tokens are counted
for both. Engine and HF runs alternate --repeats times in one process; the ratio of the best
runs and of the medians is printed.

GPU mode (--gpu): decode tokens/s and model-bandwidth utilisation (weights + KV read per decode
step / step time / peak HBM bandwidth) at batch 1 and 64 on the `1b` preset, with CUDA graphs,
and HF `generate` on the same GPU and requests beside it.

    python scripts/bench_throughput.py                 # CPU, bench preset, made on first use
    python scripts/bench_throughput.py --preset tiny   # or small
    python scripts/bench_throughput.py --model DIR --num-requests 128
    python scripts/bench_throughput.py --default-model   # SmolLM2-135M-Instruct (GGUF Q4_1)
    python scripts/bench_throughput.py --gpu [--model DIR] [--peak-gbps 4800]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_requests(n: int, vocab: int, seed: int, prompt_range, output_range):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        reqs.append(([rng.randrange(3, vocab) for _ in range(plen)], rng.randint(*output_range)))
    return reqs


def engine_runner(model: str, reqs, dtype: str, max_num_seqs: int, max_num_batched_tokens: int | None):
    """A warmed-up engine; the returned callable runs all `reqs` once -> (seconds, output tokens)."""
    from engine import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, max_num_seqs=max_num_seqs, enable_prefix_caching=False,
              max_num_batched_tokens=max_num_batched_tokens)
    llm.generate([{"prompt_token_ids": reqs[0][0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]

    def run() -> tuple[float, int]:
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        assert produced == sum(o for _, o in reqs), "engine produced a different number of tokens"
        return elapsed, produced

    return run


def hf_runner(model: str, reqs, dtype: str, batch_size: int):
    """HF `generate` loaded and warmed up; the returned callable runs all `reqs` once in
    left-padded batches -> (seconds, output tokens)."""
    from transformers import AutoModelForCausalLM

    from engine.models.gguf_file import hf_pretrained_args

    torch_dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}[dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path, kwargs = hf_pretrained_args(model)  # a GGUF file: transformers dequantizes it too
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **kwargs).to(device).eval()
    pad = hf.generation_config.pad_token_id or 0

    def generate(batch):
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        new = max(o for _, o in batch)
        with torch.no_grad():
            hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                        min_new_tokens=new, do_sample=False, pad_token_id=pad)

    generate(reqs[:2])  # warm-up
    batches = [reqs[i : i + batch_size] for i in range(0, len(reqs), batch_size)]
    computed = sum(len(b) * (max(len(p) for p, _ in b) + max(o for _, o in b)) for b in batches)
    useful = sum(len(p) + o for p, o in reqs)
    print(f"HF computes {computed} token positions for {useful} useful ones "
          f"(padding factor {computed / useful:.2f}x)")

    def run() -> tuple[float, int]:
        t0 = time.perf_counter()
        for batch in batches:
            generate(batch)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, sum(o for _, o in reqs)

    return run


def gpu_decode_run(model: str, batch: int, prompt_len: int, output_len: int, vocab: int, eager: bool):
    """Run `batch` identical-length requests; returns (decode tok/s, mean decode step seconds,
    mean context length during decode, engine)."""
    from engine import SamplingParams
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineArgs(model, enable_prefix_caching=False, enforce_eager=eager,
                               max_num_seqs=max(batch, 1)).create_engine_config())
    rng = random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"w{i}", {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt_len)]}, params)
    eng.step()  # prefill (whole batch fits the default budget for these sizes)
    steps, ctx_sum, t0 = 0, 0, None
    while eng.has_unfinished_requests():
        torch.cuda.synchronize()
        start = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        if steps >= 3:  # skip the first steps (allocator and graph warm-up)
            t0 = (t0 or 0.0) + time.perf_counter() - start
            ctx_sum += prompt_len + steps + 1
        steps += 1
    measured = steps - 3
    step_s = t0 / measured
    return batch / step_s, step_s, ctx_sum / measured, eng


def gpu_main(args) -> None:
    from engine.models.arch import load_arch
    from engine.models.default_model import ensure_preset_model
    from scripts.gpu_roofline import (
        decode_step_bytes,
        model_bandwidth_utilization,
        peak_bandwidth_gbps,
    )

    if not torch.cuda.is_available():
        sys.exit("--gpu needs a CUDA GPU")
    model = args.model or ensure_preset_model("1b")
    arch = load_arch(model)
    name = torch.cuda.get_device_name()
    peak = peak_bandwidth_gbps(name, args.peak_gbps)
    print(f"device={name} peak={peak} GB/s model={model} layers={arch.num_layers} hidden={arch.hidden_size}")
    vocab = min(arch.vocab_size, 1400)
    for batch in (1, 64):
        for eager in (False, True):
            tps, step_s, ctx, eng = gpu_decode_run(model, batch, 128, args.gpu_output_len, vocab, eager)
            m = eng.core.executor.worker.runner.model
            itemsize = next(m.parameters()).element_size()
            weights = sum(p.numel() for p in m.parameters()) * itemsize
            if m.lm_head is not None:  # an untied embedding is only gathered, not streamed
                weights -= m.embed_tokens.weight.numel() * itemsize
            nbytes = decode_step_bytes(weights, [int(ctx)] * batch, arch.num_layers, arch.num_kv_heads,
                                       arch.head_dim, itemsize)
            mbu = f"{100 * model_bandwidth_utilization(nbytes, step_s, peak):.1f}%" if peak else "n/a"
            mode = "eager" if eager else "cuda-graphs"
            print(f"pdserve batch {batch:>3} {mode:<11}: {tps:9.1f} decode tok/s, step {step_s * 1e3:.2f} ms, MBU {mbu}")
            del m, eng
            gc.collect()  # the engine's reference cycles and graphs hold its KV cache until then
            torch.cuda.empty_cache()
    reqs = make_requests(64, vocab, args.seed, (128, 128), (args.gpu_output_len, args.gpu_output_len))
    # CPU seconds of this process (every thread) per output token: the host work a GPU engine
    # does per token, which the serving layer's own per-token cost must stay well under.
    def timed(run) -> tuple[float, int, float]:
        cpu0 = time.process_time()
        seconds, tokens = run()
        return seconds, tokens, time.process_time() - cpu0

    t_eng, n_eng, cpu_eng = timed(engine_runner(model, reqs, "auto", 256, None))
    gc.collect()  # the engine (its KV cache: 0.9 of the card) goes before HF loads
    torch.cuda.empty_cache()
    t_hf, n_hf, cpu_hf = timed(hf_runner(model, reqs, "bfloat16", 64))
    print(f"batch 64 end to end: pdserve {n_eng / t_eng:.1f} tok/s, HF generate {n_hf / t_hf:.1f} tok/s, "
          f"ratio {(n_eng / t_eng) / (n_hf / t_hf):.2f}x; host CPU per output token: pdserve "
          f"{1e3 * cpu_eng / n_eng:.3f} ms, HF {1e3 * cpu_hf / n_hf:.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir or .gguf file (default: the --preset model, made "
                    "on first use)")
    ap.add_argument("--preset", default="bench", choices=("tiny", "small", "bench"))
    ap.add_argument("--default-model", action="store_true",
                    help="the default model of pdserve (SmolLM2-135M-Instruct, GGUF), dequantized by both")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 128))
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="engine and HF runs, alternated")
    ap.add_argument("--gpu", action="store_true", help="GPU mode: decode MBU at batch 1/64 and HF beside")
    ap.add_argument("--gpu-output-len", type=int, default=256)
    ap.add_argument("--peak-gbps", type=float, default=None)
    args = ap.parse_args()
    if args.gpu:
        gpu_main(args)
        return

    from engine.models.arch import load_arch
    from engine.models.default_model import default_model, ensure_preset_model

    if args.default_model:
        model = default_model()
    else:
        model = args.model or ensure_preset_model(args.preset)
    vocab = load_arch(model).vocab_size - 64
    reqs = make_requests(args.num_requests, vocab, args.seed, args.prompt_len, args.output_len)
    print(f"model={model} requests={len(reqs)} prompt_tokens={sum(len(p) for p, _ in reqs)} "
          f"output_tokens={sum(o for _, o in reqs)} torch_threads={torch.get_num_threads()}")
    engine = engine_runner(model, reqs, args.dtype, args.max_num_seqs, args.max_num_batched_tokens)
    hf = None if args.skip_hf else hf_runner(model, reqs, args.dtype, args.hf_batch_size)
    # Alternated, so a burst of load elsewhere on the machine hits both sides alike; the best
    # run of each side is the one least disturbed.
    rates: dict[str, list[float]] = {"pdserve engine": [], "HF generate": []}
    for i in range(args.repeats):
        for name, run in (("pdserve engine", engine), ("HF generate", hf)):
            if run is None:
                continue
            seconds, tokens = run()
            rates[name].append(tokens / seconds)
            print(f"run {i + 1}/{args.repeats} {name:<14}: {tokens / seconds:8.1f} output tok/s ({seconds:.1f} s)")
    for name, r in rates.items():
        if r:
            print(f"{name:<14}: best {max(r):8.1f}, median {statistics.median(r):8.1f} output tok/s")
    if hf is not None:
        print(f"ratio engine/HF: best {max(rates['pdserve engine']) / max(rates['HF generate']):.2f}x, "
              f"median {statistics.median(rates['pdserve engine']) / statistics.median(rates['HF generate']):.2f}x "
              f"(HF batch {args.hf_batch_size})")

if __name__ == "__main__":
    main()
