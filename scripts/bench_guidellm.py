"""`pdserve serve` driven by guidellm (an established load generator, not our own client),
against the offline engine on the same request shapes, in one run.

For each of --modes (colocated, pd): start `pdserve serve` on a free port (served model name =
the model path, so guidellm's tokenizer loads from it), run `guidellm run` with --concurrency
closed-loop streams, synthetic prompts of --prompt-tokens and exactly --output-tokens output
tokens (guidellm sends ignore_eos) for --requests requests, read its JSON report, stop the
server. Then the offline engine (LLMEngine in this process, the machine's torch threads) runs
the same number of requests of the prompt length the server saw, --concurrency at a time,
and the HTTP/offline throughput ratio is printed beside guidellm's TTFT and ITL.

guidellm is not imported: any `guidellm` executable works (--guidellm PATH). It is the `bench`
extra (`pip install 'pdserve[bench]'`); its pins move some of Ray's dependencies (pip would
downgrade click and multidict), so a separate virtualenv is the safe place for it.

    python scripts/bench_guidellm.py --guidellm /path/to/venv/bin/guidellm [--preset small]
        [--model DIR] [--modes colocated,pd] [--concurrency 8] [--requests 64]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.serve_bench.server import ServerProcess, free_port, server_command  # noqa: E402


def tokenizer_dir(model: str) -> str:
    """A directory guidellm's tokenizer loader can read: the model's own, or for a GGUF file
    the tokenizer pdserve converted from it (its cache, engine.models.gguf_tokenizer)."""
    from engine.models.gguf_file import find_gguf

    gguf = find_gguf(model)
    if gguf is None:
        return model
    from engine.models.gguf_tokenizer import gguf_tokenizer_dir

    return gguf_tokenizer_dir(gguf)


def run_guidellm(guidellm: str, url: str, model: str, tokenizer: str, args, out_json: str) -> dict:
    cmd = [
        guidellm, "run",
        "--backend", f"kind=openai_http,target={url},model={model}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer}",
        "--profile", f"kind=concurrent,streams={args.concurrency}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--seed", f"kind=static,value={args.seed}",
        "--output", f"kind=json,path={out_json}",
        "--disable-progress",
    ]
    # guidellm shares the machine with the server: its own CPU seconds are reported beside the
    # throughput (children's usage grows once the run is waited for, and only this one is).
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=args.timeout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    loadgen_cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    with open(out_json) as f:
        bench = json.load(f)["benchmarks"][0]
    m = bench["metrics"]

    def ok(name: str) -> dict:
        return m[name]["successful"]

    tokens = ok("output_token_count")["total_sum"]
    return {
        "requests": ok("request_latency")["count"],
        "errors": m["request_latency"]["errored"]["count"],
        "prompt_tokens": ok("prompt_token_count")["mean"],
        "output_tokens": tokens,
        "seconds": bench["duration"],
        "tok_s": tokens / bench["duration"],
        "ttft_p50_ms": ok("time_to_first_token_ms")["percentiles"]["p50"],
        "ttft_p95_ms": ok("time_to_first_token_ms")["percentiles"]["p95"],
        "itl_p50_ms": ok("inter_token_latency_ms")["percentiles"]["p50"],
        "itl_p95_ms": ok("inter_token_latency_ms")["percentiles"]["p95"],
        "loadgen_cpu_s": loadgen_cpu_s,
    }


def run_offline(model: str, prompt_tokens: int, args) -> dict:
    """The engine alone: `requests` prompts of `prompt_tokens` random ids, `concurrency` at a
    time, each generating exactly `output_tokens` (after a warm-up on other prompts)."""
    from engine.models.arch import load_arch
    from scripts.serve_bench.offline import make_engine, run_closed_loop

    vocab = load_arch(model).vocab_size - 64
    rng = random.Random(args.seed)

    def prompts(n: int) -> list[dict]:
        return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt_tokens)]} for _ in range(n)]

    engine = make_engine(model, max(args.concurrency, 1))
    run_closed_loop(engine, prompts(args.concurrency), 4, args.concurrency, "warm")
    work = prompts(args.requests)
    t0 = time.perf_counter()
    tokens, _ = run_closed_loop(engine, work, args.output_tokens, args.concurrency, "run")
    seconds = time.perf_counter() - t0
    return {"output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def bench_mode(mode: str, model: str, tokenizer: str, guidellm: str, args, tmp: str) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = os.path.join(tmp, f"serve-{mode}.log")
    server = ServerProcess(server_command(mode, port, model, None, model, args.server_args.split()), log)
    try:
        server.wait_ready(url, args.start_timeout)
        return run_guidellm(guidellm, url, model, tokenizer, args,
                            os.path.join(tmp, f"guidellm-{mode}.json"))
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--guidellm", default=shutil.which("guidellm"), help="the guidellm executable")
    ap.add_argument("--model", default=None, help="model dir or .gguf file (default: the --preset model, made "
                    "on first use)")
    ap.add_argument("--default-model", action="store_true",
                    help="the default model of pdserve (SmolLM2-135M-Instruct, GGUF)")
    ap.add_argument("--preset", default="small", choices=("tiny", "small", "bench"))
    ap.add_argument("--modes", default="colocated,pd")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", default="", help="extra `pdserve serve` arguments")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="per guidellm run, seconds")
    ap.add_argument("--json", default=None, help="write every figure here")
    args = ap.parse_args(argv)
    if not args.guidellm:
        ap.error("no guidellm executable found: pip install 'pdserve[bench]' (ideally in its own venv) "
                 "and pass --guidellm PATH")
    from engine.models.default_model import ensure_preset_model

    if args.default_model:
        from engine.models.default_model import default_model

        args.model = default_model()
    model = os.path.abspath(args.model or ensure_preset_model(args.preset))
    results: dict[str, dict] = {}
    tokenizer = tokenizer_dir(model)
    with tempfile.TemporaryDirectory(prefix="bench-guidellm-") as tmp:
        for mode in args.modes.split(","):
            results[mode] = bench_mode(mode, model, tokenizer, args.guidellm, args, tmp)
            print(f"{mode}: {json.dumps(results[mode])}", flush=True)
    prompt_tokens = round(next(iter(results.values()))["prompt_tokens"])
    results["offline"] = run_offline(model, prompt_tokens, args)
    offline = results["offline"]["tok_s"]
    print(f"\nmodel={model} concurrency={args.concurrency} requests={args.requests} "
          f"prompt={prompt_tokens} tokens output={args.output_tokens} tokens")
    print(f"{'':<10} {'tok/s':>8} {'HTTP/offline':>13} {'TTFT p50/p95 ms':>18} {'ITL p50/p95 ms':>16} "
          f"{'guidellm CPU-s / run s':>23}")
    print(f"{'offline':<10} {offline:8.1f} {'':>13}")
    for mode in args.modes.split(","):
        r = results[mode]
        print(f"{mode:<10} {r['tok_s']:8.1f} {r['tok_s'] / offline:12.2f}x "
              f"{r['ttft_p50_ms']:8.0f} /{r['ttft_p95_ms']:7.0f} {r['itl_p50_ms']:7.1f} /{r['itl_p95_ms']:6.1f} "
              f"{r['loadgen_cpu_s']:11.1f} / {r['seconds']:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
