"""HTTP serving benchmark for an OpenAI-compatible server (pdserve's Ray Serve app).

Streams `POST /v1/completions` requests (temperature 0, EOS ignored, usage in the last chunk)
with synthetic prompts of random word counts and random output lengths, all seeded, and
reports per-request latency percentiles, throughput and goodput against TTFT/TPOT SLOs:

- TTFT: request sent -> first chunk carrying text; ITL: gaps between consecutive text chunks;
  TPOT: (E2E - TTFT) / (completion tokens - 1); E2E: request sent -> end of stream.
- goodput: successful requests/s that met both SLOs (--slo-ttft-ms, --slo-tpot-ms).

Arrivals are Poisson (--rate R requests/s) or a fixed number of closed-loop workers
(--concurrency C). Two warm-up requests go first and are not measured.

Against a running server:

    python scripts/bench_serve.py --url http://127.0.0.1:8000 [--served-model NAME] \\
        [--requests 200] [--rate 8 | --concurrency 16] [--json out.json]

P/D against colocated (the default when no --url is given): for each of --modes, start
`python -m cluster.launch.cli serve --mode MODE` on a free port, wait for GET /health, run the same
workload, stop the server (SIGINT), then print both tables and the P/D / colocated ratios:

    python scripts/bench_serve.py [--compare] [--model DIR] [--num-kv-blocks N] \\
        [--server-args "--prefill-replicas 1 --decode-replicas 1"] [--requests 100 --rate 4]
"""


from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# After the path set-up above, so the script runs from any directory.
from scripts.serve_bench import BenchError  # noqa: E402
from scripts.serve_bench.client import first_model_id, run_load  # noqa: E402
from scripts.serve_bench.records import RequestRecord, summarise  # noqa: E402
from scripts.serve_bench.report import compare_ratios, format_ratios, format_summary  # noqa: E402
from scripts.serve_bench.server import ServerProcess, free_port, server_command  # noqa: E402
from scripts.serve_bench.workload import WorkItem, make_workload  # noqa: E402


def bench_url(args, url: str, model: str, workload: list[WorkItem]) -> tuple[dict, list[RequestRecord]]:
    records, wall = asyncio.run(run_load(
        url, model, workload, rate=args.rate, concurrency=args.concurrency, seed=args.seed,
        timeout_s=args.timeout, warmup=args.warmup))
    return summarise(records, args.slo_ttft_ms, args.slo_tpot_ms, wall), records


def bench_mode(args, mode: str, workload: list[WorkItem], log_dir: str):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_command(mode, port, args.model, args.num_kv_blocks, args.served_model,
                         shlex.split(args.server_args or ""))
    log_path = os.path.join(log_dir, f"server-{mode}.log")
    print(f"\n[{mode}] starting: {shlex.join(cmd)}\n[{mode}] log: {log_path}", flush=True)
    server = ServerProcess(cmd, log_path)
    try:
        t0 = time.monotonic()
        server.wait_ready(url, args.startup_timeout)
        model = args.served_model or first_model_id(url)
        print(f"[{mode}] ready in {time.monotonic() - t0:.1f} s, model {model!r}; running", flush=True)
        return bench_url(args, url, model, workload)
    finally:
        server.stop(args.stop_timeout)


def _load_desc(args) -> str:
    arrivals = (f"concurrency {args.concurrency}" if args.concurrency
                else f"Poisson {args.rate:g} req/s")
    return (f"{args.requests} requests, {arrivals}, prompts {args.input_len_min}-{args.input_len_max} "
            f"words, outputs {args.output_len_min}-{args.output_len_max} tokens, seed {args.seed}")


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
    print(f"wrote {path}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = ap.add_argument_group("target")
    target.add_argument("--url", default=None, help="benchmark this running server (e.g. http://127.0.0.1:8000)")
    target.add_argument("--served-model", default=None,
                        help="model name in requests (default: first id of GET /v1/models)")
    target.add_argument("--compare", action="store_true",
                        help="start a server per --modes and compare them (the default without --url)")
    target.add_argument("--modes", default="pd,colocated", help="comma list of serve modes for --compare")
    target.add_argument("--model", default=None, help="--compare: model dir (default: the server's default)")
    target.add_argument("--num-kv-blocks", type=int, default=None, help="--compare: passed to the server")
    target.add_argument("--server-args", default="", help="--compare: extra `pdserve serve` flags in one string "
                        "(write --server-args=--flag for a single flag)")
    target.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for /health")
    target.add_argument("--stop-timeout", type=float, default=60.0, help="seconds after SIGINT before kill")
    target.add_argument("--log-dir", default=None, help="--compare: server logs (default: a temp dir)")

    load = ap.add_argument_group("workload")
    load.add_argument("--requests", type=int, default=100, help="measured requests")
    arrivals = load.add_mutually_exclusive_group()
    arrivals.add_argument("--rate", type=float, default=None,
                          help="Poisson arrivals, requests/s ('inf': all at once); default 4")
    arrivals.add_argument("--concurrency", type=int, default=None, help="closed-loop workers")
    load.add_argument("--input-len-min", type=int, default=32, help="prompt words, min")
    load.add_argument("--input-len-max", type=int, default=256, help="prompt words, max")
    load.add_argument("--output-len-min", type=int, default=32, help="max_tokens, min")
    load.add_argument("--output-len-max", type=int, default=128, help="max_tokens, max")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--warmup", type=int, default=2, help="unmeasured requests sent first")
    load.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, seconds")

    rep = ap.add_argument_group("report")
    rep.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    rep.add_argument("--slo-tpot-ms", type=float, default=100.0)
    rep.add_argument("--json", metavar="OUT", default=None, help="write summaries and records as JSON")
    return ap


def check_args(ap: argparse.ArgumentParser, args) -> None:
    if args.url and args.compare:
        ap.error("--url and --compare are exclusive")
    if args.rate is None and args.concurrency is None:
        args.rate = 4.0
    if args.rate is not None and not args.rate > 0:
        ap.error("--rate must be > 0")
    if args.concurrency is not None and args.concurrency < 1:
        ap.error("--concurrency must be >= 1")
    if args.requests < 1 or args.warmup < 0 or args.timeout <= 0:
        ap.error("--requests must be >= 1, --warmup >= 0, --timeout > 0")
    if not 1 <= args.input_len_min <= args.input_len_max:
        ap.error("need 1 <= --input-len-min <= --input-len-max")
    if not 1 <= args.output_len_min <= args.output_len_max:
        ap.error("need 1 <= --output-len-min <= --output-len-max")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in ("pd", "colocated")]
    if bad or not args.modes:
        ap.error(f"--modes: expected pd and/or colocated, got {args.modes}")
    if args.url:
        args.url = args.url.rstrip("/")


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    workload = make_workload(args.requests, args.seed, (args.input_len_min, args.input_len_max),
                             (args.output_len_min, args.output_len_max))
    config = dict(vars(args))

    if args.url:
        try:
            model = args.served_model or first_model_id(args.url)
            print(f"{args.url}, model {model!r}: {_load_desc(args)}", flush=True)
            summary, records = bench_url(args, args.url, model, workload)
        except BenchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(format_summary(args.url, summary))
        if args.json:
            _write_json(args.json, {"config": config, "model": model, "summary": summary,
                                    "records": [r.to_dict() for r in records]})
        return 0 if summary["successful"] else 1

    log_dir = args.log_dir or tempfile.mkdtemp(prefix="bench_serve_")
    os.makedirs(log_dir, exist_ok=True)
    print(f"compare {', '.join(args.modes)}: {_load_desc(args)}", flush=True)
    results, failures = {}, {}
    for mode in args.modes:
        try:
            summary, records = bench_mode(args, mode, workload, log_dir)
        except BenchError as e:
            print(f"[{mode}] error: {e}", file=sys.stderr)
            failures[mode] = str(e)
            continue
        results[mode] = {"summary": summary, "records": [r.to_dict() for r in records]}
        print(f"[{mode}] done: {summary['successful']}/{summary['requests']} ok", flush=True)

    print()
    for mode, res in results.items():
        print(format_summary(mode, res["summary"]))
        print()
    ratios = None
    if "pd" in results and "colocated" in results:
        ratios = compare_ratios(results["pd"]["summary"], results["colocated"]["summary"])
        print(format_ratios(ratios))
    for mode, msg in failures.items():
        print(f"{mode}: failed: {msg.splitlines()[0]}")
    if args.json:
        _write_json(args.json, {"config": config, "results": results, "failures": failures,
                                "ratios": ratios})
    ok = not failures and all(r["summary"]["successful"] for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
