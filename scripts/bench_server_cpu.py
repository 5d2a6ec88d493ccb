"""CPU per output token of the whole HTTP server, by process role, next to the offline engine's.

For each serve mode (colocated, P/D) and load (closed-loop concurrency 8 and 64; prompts of
exactly --prompt-tokens tokens, --output-tokens tokens out, greedy, EOS ignored), start
`pdserve serve` (scripts/serve_bench/server.py), warm it up, then read the CPU time of every
process under it from /proc before and after the measured requests (start-up excluded) and
group it by role: proxy, ingress, engines, KV store, control, Ray daemons
(scripts/serve_bench/proc_cpu.py). The offline engine runs the same prompts in this process,
`concurrency` requests at a time, and its process CPU time is the baseline. Each window is
run --repeats times on fresh prompts, offline and served alike, and the one with the least
CPU per token is kept: other processes on a shared machine only ever add CPU time.

Also measured: the colocated server at each --intervals (`--stream-interval-ms`), to choose
its default; and the bytes of the per-step messages an engine replica sends its ingress for
prompts of 256 and 8k tokens (built from a real engine's step outputs by the replica's own
FrontEndChannel, pickled as Ray ships them; the 8k model is --preset with a longer context).
The issue's goals are printed as PASS/FAIL lines.

    python scripts/bench_server_cpu.py                      # small preset, made on first use
    python scripts/bench_server_cpu.py --model PATH         # any model `pdserve serve` takes
    python scripts/bench_server_cpu.py --modes colocated --intervals 0 --skip-bytes

Linux only (/proc). Run it on an otherwise idle machine: the report prints how much CPU other
processes used during each window.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shlex
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# After the path set-up above, so the script runs from any directory.
from scripts.serve_bench import BenchError  # noqa: E402
from scripts.serve_bench.client import first_model_id, run_load  # noqa: E402
from scripts.serve_bench.cpu_report import (  # noqa: E402
    ServerRun,
    bytes_table,
    goal_lines,
    hop_table,
    interval_table,
    role_table,
)
from scripts.serve_bench.offline import make_engine, measure_message_sizes, measure_offline  # noqa: E402
from scripts.serve_bench.proc_cpu import cpu_by_role, live_since, snapshot, system_busy_s  # noqa: E402
from scripts.serve_bench.records import summarise  # noqa: E402
from scripts.serve_bench.server import ServerProcess, free_port, server_command  # noqa: E402
from scripts.serve_bench.workload import WorkItem, exact_token_prompts  # noqa: E402

# Requests of the warm-up before each measured window: short outputs, the same prompt length.
WARM_OUTPUT_TOKENS = 8


def ensure_model(path: str, preset: str, **overrides) -> str:
    """A random-weight model of `preset` at path (`pdserve make-model`), made on first use."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        from engine.models.make_model import make_model

        print(f"making the {preset} model at {path}", flush=True)
        make_model(path, preset, **overrides)
    return path


def load_sets(prompts: list[str], concurrency: list[int], requests: list[int], repeats: int
              ) -> tuple[list[str], dict]:
    """(warm-up prompts, {(concurrency, repeat): its measured prompts}): disjoint slices, so no
    measured window reuses another's prompts from the prefix cache."""
    warm, rest = prompts[: max(concurrency)], prompts[max(concurrency):]
    sets = {}
    for c, n in zip(concurrency, requests):
        for r in range(repeats):
            sets[c, r], rest = rest[:n], rest[n:]
    return warm, sets


def best(runs: list, cost) -> object:
    """The least disturbed of repeated runs: other processes on the machine only ever add
    CPU time (cache and core sharing), so the lowest CPU per token is the closest to the truth."""
    return min(runs, key=cost)


def run_offline(args, model: str) -> tuple[list[str], dict, dict]:
    """Prompts of exactly --prompt-tokens tokens, and the offline engine's runs on them."""
    import torch

    torch.set_num_threads(args.offline_threads)
    engine = make_engine(model, max(args.concurrency))
    total = max(args.concurrency) + sum(args.requests) * args.repeats
    prompts = exact_token_prompts(engine.tokenizer, total, args.prompt_tokens, args.seed)
    warm, sets = load_sets(prompts, args.concurrency, args.requests, args.repeats)
    offline = {}
    for c in [] if args.skip_offline else args.concurrency:
        runs = []
        for r in range(args.repeats):
            runs.append(o := measure_offline(engine, sets[c, r], args.output_tokens, c, warm))
            print(f"[offline c{c} #{r}] {o.output_tokens} tokens in {o.wall_s:.1f} s: {o.tok_s:.0f} tok/s, "
                  f"{o.cpu_ms_per_token:.2f} CPU ms/token, {o.steps} steps", flush=True)
        offline[c] = best(runs, lambda o: o.cpu_ms_per_token)
    del engine
    gc.collect()
    return warm, sets, offline


def run_message_sizes(args) -> list:
    context = -(-(max(args.bytes_prompts) + args.output_tokens) // 64) * 64
    model = ensure_model(os.path.join(args.model_dir, f"{args.preset}-ctx{context}"), args.preset,
                         max_position_embeddings=context)
    engine = make_engine(model, args.bytes_requests)
    sizes = []
    for n in args.bytes_prompts:
        prompts = exact_token_prompts(engine.tokenizer, args.bytes_requests, n, args.seed + n)
        sizes.append(s := measure_message_sizes(engine, prompts, n, args.output_tokens))
        print(f"[bytes {n}] {len(s.messages)} messages, {s.mean_bytes:.0f} bytes/message", flush=True)
    del engine
    gc.collect()
    return sizes


def _end_leftovers(seen: dict, wait_s: float = 15.0) -> None:
    """Processes of the stopped server still running after wait_s: killed by pid (each was
    seen under the server's pid, and its start time tells it from a reused pid)."""
    deadline = time.monotonic() + wait_s
    while (alive := live_since(seen)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in alive:
        print(f"warning: server process {pid} ({seen[pid].cmdline[:60]}) outlived the server; killing it",
              file=sys.stderr)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def measure_window(args, url: str, served: str, root: int, mode: str, interval_ms: float, c: int,
                   warm: list[str], prompts: list[str], seen: dict) -> ServerRun:
    warm_items = [WorkItem(p, WARM_OUTPUT_TOKENS) for p in warm[:c]]
    asyncio.run(run_load(url, served, warm_items, rate=None, concurrency=c, seed=args.seed,
                         timeout_s=args.timeout, warmup=2))
    items = [WorkItem(p, args.output_tokens) for p in prompts]
    before, busy0, cpu0 = snapshot(root), system_busy_s(), time.process_time()
    records, wall = asyncio.run(run_load(url, served, items, rate=None, concurrency=c, seed=args.seed,
                                         timeout_s=args.timeout, warmup=0))
    after, busy1, client = snapshot(root), system_busy_s(), time.process_time() - cpu0
    seen.update(before)
    seen.update(after)
    cpu = cpu_by_role(before, after, root)
    summary = summarise(records, float("inf"), float("inf"), wall)
    if summary["failed"]:
        raise BenchError(f"{summary['failed']} requests failed: {summary['errors']}")
    chunks = sum(r.chunks for r in records)
    others = max(busy1 - busy0 - sum(cpu.seconds.values()) - client, 0.0)
    run = ServerRun(mode, c, interval_ms, summary, cpu.seconds, cpu.exited, client, chunks, others)
    print(f"[{run.label} {interval_ms:g} ms] {run.tokens} tokens in {wall:.1f} s: "
          f"{summary['output_throughput']:.0f} tok/s, server {run.ms(run.whole_s):.2f} CPU ms/token "
          f"(outside engines {run.ms(run.outside_s):.2f}); other processes used {others:.1f} CPU s",
          flush=True)
    return run


def bench_server(args, model: str, mode: str, interval_ms: float, warm: list[str], sets: dict,
                 log_dir: str) -> list[ServerRun]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    extra = ["--stream-interval-ms", f"{interval_ms:g}"] + shlex.split(args.server_args)
    cmd = server_command(mode, port, model, None, None, extra)
    log_path = os.path.join(log_dir, f"server-{mode}-{interval_ms:g}ms.log")
    print(f"\n[{mode} {interval_ms:g} ms] {shlex.join(cmd)}\n  log: {log_path}", flush=True)
    server = ServerProcess(cmd, log_path)
    seen: dict = {}
    try:
        server.wait_ready(url, args.startup_timeout)
        served = first_model_id(url)
        runs = []
        for c in args.concurrency:
            repeats = [measure_window(args, url, served, server.proc.pid, mode, interval_ms, c, warm,
                                      sets[c, r], seen) for r in range(args.repeats)]
            runs.append(best(repeats, lambda run: run.ms(run.whole_s)))
        return runs
    finally:
        server.stop(args.stop_timeout)
        _end_leftovers(seen)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    from cluster.app import STREAM_INTERVAL_MS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path for the server and the offline engine "
                    "(default: --preset, made under --model-dir)")
    ap.add_argument("--preset", default="small", help="make-model preset of the default and the 8k model")
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "pdserve-bench-models"))
    ap.add_argument("--modes", default="colocated,pd")
    ap.add_argument("--concurrency", type=_ints, default=[8, 64], help="comma list of closed-loop client counts")
    ap.add_argument("--requests", type=_ints, default=[64, 192], help="measured requests per --concurrency entry")
    ap.add_argument("--repeats", type=int, default=2, help="measured windows per load (fresh prompts each); "
                    "the report keeps the one with the least CPU per token, offline and served alike")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--interval-ms", type=float, default=STREAM_INTERVAL_MS,
                    help="--stream-interval-ms of the mode comparison and the goals (default: the server's)")
    ap.add_argument("--intervals", default="0,10,50", help="colocated --stream-interval-ms sweep ('' for none)")
    ap.add_argument("--bytes-prompts", type=_ints, default=[256, 8192], help="prompt lengths of the message sizes")
    ap.add_argument("--bytes-requests", type=int, default=8, help="requests run together for the message sizes")
    ap.add_argument("--offline-threads", type=int, default=1, help="torch threads of the offline engine; 1 "
                    "is what an engine replica gets as shipped (Ray sets OMP_NUM_THREADS to its num_cpus, 1)")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--skip-bytes", action="store_true")
    ap.add_argument("--server-args", default="", help="extra `pdserve serve` flags in one string")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--stop-timeout", type=float, default=60.0)
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--json", metavar="OUT", default=None)
    return ap


def check_args(ap, args) -> None:
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in ("colocated", "pd") for m in args.modes):
        ap.error(f"--modes: expected colocated and/or pd, got {args.modes}")
    args.intervals = [float(x) for x in args.intervals.split(",") if x.strip()]
    if len(args.requests) != len(args.concurrency) or min(args.concurrency + args.requests) < 1:
        ap.error("--requests needs one count >= 1 per --concurrency entry (each >= 1)")
    if args.prompt_tokens < 2 or min(args.output_tokens, args.bytes_requests, args.repeats) < 1:
        ap.error("need --prompt-tokens >= 2, --output-tokens >= 1, --bytes-requests >= 1, --repeats >= 1")


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    model = args.model or ensure_model(os.path.join(args.model_dir, args.preset), args.preset)
    print(f"model {model}; {args.prompt_tokens} prompt / {args.output_tokens} output tokens; concurrency "
          f"{args.concurrency} with {args.requests} requests; {os.cpu_count()} CPUs", flush=True)
    warm, sets, offline = run_offline(args, model)
    sizes = [] if args.skip_bytes else run_message_sizes(args)

    log_dir = args.log_dir or tempfile.mkdtemp(prefix="bench_server_cpu_")
    configs = [("colocated", iv) for iv in sorted({*args.intervals, args.interval_ms})] if "colocated" in args.modes else []
    configs += [("pd", args.interval_ms)] if "pd" in args.modes else []
    runs: list[ServerRun] = []
    for mode, iv in configs:
        try:
            runs += bench_server(args, model, mode, iv, warm, sets, log_dir)
        except BenchError as e:
            print(f"[{mode} {iv:g} ms] error: {e}", file=sys.stderr)
            return 2

    main_runs = [r for r in runs if r.interval_ms == args.interval_ms]
    sweep = [r for r in runs if r.mode == "colocated" and r.interval_ms in args.intervals]
    print(f"\n## CPU by role, at --stream-interval-ms {args.interval_ms:g}\n\n{role_table(main_runs, offline)}")
    print(f"\n## Per hop\n\n{hop_table(main_runs, offline)}")
    if sweep:
        print(f"\n## Colocated, by --stream-interval-ms\n\n{interval_table(sweep)}")
    if sizes:
        print(f"\n## Bytes per streamed message\n\n{bytes_table(sizes)}")
    print("\n## Goals\n\n" + "\n".join(goal_lines(main_runs, offline, sizes)))
    print("\nnotes: " + "; ".join(
        f"{r.label} {r.interval_ms:g} ms: other processes {r.others_cpu_s:.1f} CPU s, client "
        f"{r.client_cpu_s:.1f} CPU s, {r.exited} server processes exited" for r in runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items()}, "model": model,
                       "offline": {c: vars(o) for c, o in offline.items()},
                       "runs": [vars(r) for r in runs],
                       "message_sizes": [{"prompt_tokens": s.prompt_tokens, "mean_bytes": s.mean_bytes,
                                          "steady_bytes": s.steady_bytes,
                                          "request_output_bytes": s.mean_request_output_bytes} for s in sizes]},
                      f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
