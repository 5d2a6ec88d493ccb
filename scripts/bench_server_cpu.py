"""CPU per output token of the whole HTTP server, by process role, next to the offline engine's.

For each serve mode (colocated, P/D) and load (closed-loop concurrency 8 and 64; prompts of
exactly --prompt-tokens tokens, --output-tokens tokens out, greedy, EOS ignored), start
`pdserve serve` (scripts/serve_bench/server.py), warm it up, then read the CPU time of every
process under it from /proc before and after the measured requests (start-up excluded) and
group it by role: proxy, ingress, engines, KV store, control, Ray daemons
(scripts/serve_bench/proc_cpu.py). The offline engine runs the same prompts in this process,
`concurrency` requests at a time, and its process CPU time is the baseline. Each served
window is paired with an offline one run just before it on the same fresh prompts (so both
see the same machine), each pair is run --repeats times, and the pair beside which other
processes used the least CPU is kept: on a shared machine others only ever add CPU time.

Also measured: the colocated server at each --intervals (`--stream-interval-ms`), to choose
its default; and the bytes of the per-step messages an engine replica sends its ingress for
prompts of 256 and 8k tokens (built from a real engine's step outputs by the replica's own
IngressChannel, pickled as Ray ships them; the 8k model is --preset with a longer context).
The CPU goals are printed as PASS/FAIL lines.

    python scripts/bench_server_cpu.py                      # small preset, made on first use
    python scripts/bench_server_cpu.py --model PATH         # any model `pdserve serve` takes
    python scripts/bench_server_cpu.py --modes colocated --intervals 0 --skip-bytes

Linux only (/proc). Run it on an otherwise idle machine: the report prints how much CPU other
processes used during each window.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import shlex
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# After the path set-up above, so the script runs from any directory.
from cluster.launch.app_checks import direct_role  # noqa: E402
from scripts.serve_bench import BenchError  # noqa: E402
from scripts.serve_bench.client import engine_steps, first_model_id, run_load  # noqa: E402
from scripts.serve_bench.cpu_report import (  # noqa: E402
    ServerRun,
    bytes_table,
    goal_lines,
    hop_table,
    interval_table,
    role_table,
)
from scripts.serve_bench.offline import (  # noqa: E402
    OfflineRun,
    make_engine,
    make_pd_engines,
    measure_message_sizes,
    measure_offline,
    measure_offline_pd,
)
from scripts.serve_bench.proc_cpu import (  # noqa: E402
    cpu_by_role,
    end_leftovers,
    snapshot,
    system_busy_s,
    wait_quiet,
)
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


def split_prompts(prompts: list[str], counts: dict) -> dict:
    """{key: its own slice of prompts} for {key: count}: disjoint, so no measured window finds
    its prompts in a prefix cache (the offline engine's lives through every pair)."""
    out, rest = {}, prompts
    for key, n in counts.items():
        out[key], rest = rest[:n], rest[n:]
    if len(out) != len(counts) or any(len(out[k]) != n for k, n in counts.items()):
        raise ValueError(f"{len(prompts)} prompts cannot fill {sum(counts.values())}")
    return out


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


class Bench:
    """The offline engine (alive through the whole run) and the prompts of every window."""

    def __init__(self, args, model: str, configs: list[tuple[str, float]]) -> None:
        import torch

        from engine.tokenizer import load_tokenizer

        torch.set_num_threads(args.offline_threads)
        self.args, self.model = args, model
        self.idle: dict[str, dict[str, float]] = {}  # mode -> role -> CPU s per idle minute
        # On a GPU the offline engines and the server's share the card: each takes its fraction.
        kw = ({"gpu_memory_utilization": args.gpu_memory_utilization}
              if args.gpu_memory_utilization is not None else {})
        self.engine = None if args.skip_offline else make_engine(model, max(args.concurrency), **kw)
        self.pd_engines = (make_pd_engines(model, max(args.concurrency), **kw)
                           if not args.skip_offline and any(mode == "pd" for mode, _ in configs) else None)
        # Without an offline engine, only its tokenizer: an engine made for it would hold its
        # share of a GPU (its KV cache) until collected, beside the server's.
        tokenizer = self.engine.tokenizer if self.engine else load_tokenizer(model)
        counts = {"warm": max(args.concurrency)}
        for config in configs:
            for c, n in zip(args.concurrency, args.requests):
                for r in range(args.repeats):
                    counts[config, c, r] = n
        prompts = exact_token_prompts(tokenizer, sum(counts.values()), args.prompt_tokens, args.seed)
        self.prompts = split_prompts(prompts, counts)

    def quiet(self, what: str) -> None:
        rate = wait_quiet(self.args.quiet_wait_s, self.args.quiet_cores)
        if rate >= self.args.quiet_cores:
            print(f"  ({what}: machine still busy, {rate:.1f} cores, after {self.args.quiet_wait_s:g} s)",
                  flush=True)

    def offline(self, prompts: list[str], c: int, pd: bool = False) -> OfflineRun | None:
        """The offline engine (`pd`: the P/D engine pair) on these prompts, `c` at a time."""
        engines = self.pd_engines if pd else self.engine
        if engines is None:
            return None
        busy0 = system_busy_s()
        measure = measure_offline_pd if pd else measure_offline
        o = measure(engines, prompts, self.args.output_tokens, c, self.prompts["warm"])
        o.others_cpu_s = max(system_busy_s() - busy0 - o.cpu_s, 0.0)
        print(f"  offline{' P/D engines' if pd else ''} c{c}: {o.tok_s:.0f} tok/s, {o.cpu_ms_per_token:.2f} "
              f"CPU ms/token; other processes {o.others_cpu_s:.1f} CPU s", flush=True)
        return o

    def window(self, url: str, served: str, root: int, config, c: int, r: int, seen: dict) -> ServerRun:
        """One pair: the offline engine, then the server, on the same fresh prompts."""
        args, (mode, interval_ms) = self.args, config
        prompts = self.prompts[config, c, r]
        if r == 0:
            warm = [WorkItem(p, WARM_OUTPUT_TOKENS) for p in self.prompts["warm"][:c]]
            asyncio.run(run_load(url, served, warm, rate=None, concurrency=c, seed=args.seed,
                                 timeout_s=args.timeout, warmup=2))
        self.quiet(f"{mode} c{c}")
        offline = self.offline(prompts, c)
        offline_pd = self.offline(prompts, c, pd=True) if mode == "pd" else None
        items = [WorkItem(p, args.output_tokens) for p in prompts]
        steps0 = engine_steps(url)
        before, busy0, cpu0 = snapshot(root), system_busy_s(), time.process_time()
        records, wall = asyncio.run(run_load(url, served, items, rate=None, concurrency=c, seed=args.seed,
                                             timeout_s=args.timeout, warmup=0))
        after, busy1, client = snapshot(root), system_busy_s(), time.process_time() - cpu0
        steps = {role: n - steps0.get(role, 0.0) for role, n in settled_engine_steps(url).items()}
        seen.update(before)
        seen.update(after)
        cpu = cpu_by_role(before, after, root, direct_role(mode))
        summary = summarise(records, float("inf"), float("inf"), wall)
        if summary["failed"]:
            raise BenchError(f"{summary['failed']} requests failed: {summary['errors']}")
        # EOS is ignored, so every answer has exactly the tokens asked for: fewer means the
        # stream lost some (a figure over lost tokens would look faster, not wrong).
        wrong = [rec.completion_tokens for rec in records if rec.completion_tokens != args.output_tokens]
        if wrong:
            raise BenchError(f"{len(wrong)} of {len(records)} answers had other than {args.output_tokens} "
                             f"tokens ({sorted(set(wrong))[:5]}): the server lost or added tokens")
        others = max(busy1 - busy0 - sum(cpu.seconds.values()) - client, 0.0)
        run = ServerRun(mode, c, interval_ms, summary, cpu.seconds, cpu.exited, client,
                        sum(rec.chunks for rec in records), others, offline, offline_pd, steps)
        print(f"[{run.label} {interval_ms:g} ms #{r}] {run.tokens} tokens in {wall:.1f} s: "
              f"{summary['output_throughput']:.0f} tok/s, server {run.ms(run.whole_s):.2f} CPU ms/token "
              f"(outside engines {run.ms(run.outside_s):.2f}); other processes {others:.1f} CPU s", flush=True)
        return run

    def idle_window(self, config, root: int, seen: dict) -> None:
        """CPU per minute of each role while the server is up and nobody calls it: what its
        control loops, health checks and heartbeats cost by themselves."""
        mode, interval_ms = config
        self.quiet(f"{mode} idle")
        before = snapshot(root)
        time.sleep(self.args.idle_s)  # the measured window itself, not a synchronisation
        after = snapshot(root)
        seen.update(before)
        seen.update(after)
        per_min = {role: s * 60.0 / self.args.idle_s for role, s in cpu_by_role(before, after, root, direct_role(mode)).seconds.items()}
        self.idle[mode] = per_min
        print(f"  [{mode} idle {self.args.idle_s:g} s] CPU s per minute: " + ", ".join(
            f"{role} {v:.2f}" for role, v in sorted(per_min.items(), key=lambda kv: -kv[1])), flush=True)

    def server(self, config, log_dir: str) -> list[ServerRun]:
        """Start `pdserve serve` for config, measure each load --repeats times, stop it. Of the
        repeats, the pair that ran beside the least CPU of other processes is kept."""
        args, (mode, interval_ms) = self.args, config
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        extra = ["--stream-interval-ms", f"{interval_ms:g}"] + shlex.split(args.server_args)
        if args.gpu_memory_utilization is not None:
            extra += ["--gpu-memory-utilization", f"{args.gpu_memory_utilization:g}"]
        if "--replica-cpus" not in extra:
            # CPU seconds compare only at equal threads: more threads spend more CPU per token.
            extra += ["--replica-cpus", str(args.offline_threads)]
        cmd = server_command(mode, port, self.model, None, None, extra)
        log_path = os.path.join(log_dir, f"server-{mode}-{interval_ms:g}ms.log")
        print(f"\n[{mode} {interval_ms:g} ms] {shlex.join(cmd)}\n  log: {log_path}", flush=True)
        server = ServerProcess(cmd, log_path)
        seen: dict = {}
        try:
            server.wait_ready(url, args.startup_timeout)
            served = first_model_id(url)
            if args.idle_s > 0:
                self.idle_window(config, server.proc.pid, seen)
            runs = []
            for c in args.concurrency:
                pairs = [self.window(url, served, server.proc.pid, config, c, r, seen) for r in range(args.repeats)]
                runs.append(min(pairs, key=lambda run: run.others_cpu_s + (run.offline.others_cpu_s
                                                                             if run.offline else 0.0)))
            return runs
        finally:
            server.stop(args.stop_timeout)
            for pid in end_leftovers(seen):
                print(f"warning: server process {pid} ({seen[pid].cmdline[:60]}) outlived the server; "
                      f"killed it", file=sys.stderr)


def settled_engine_steps(url: str, quiet_s: float = 1.0, bound_s: float = 10.0) -> dict[str, float]:
    """The engines' step counters once they stop moving: replicas report them with their
    routing stats (every 0.5 s, cluster.launch.app), so the last steps of a window reach /metrics up
    to that much after its last response. Read after the CPU snapshot, so not measured."""
    last, since, t_end = engine_steps(url), time.monotonic(), time.monotonic() + bound_s
    while time.monotonic() < t_end:
        time.sleep(0.25)  # a polling period (bounded by bound_s), not a synchronisation
        now = engine_steps(url)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    from cluster.launch.app_config import STREAM_INTERVAL_MS

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
    ap.add_argument("--quiet-wait-s", type=float, default=30.0,
                    help="before each window, wait up to this long for the machine to be quiet")
    ap.add_argument("--quiet-cores", type=float, default=0.3, help="'quiet': less CPU than this in use")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--interval-ms", type=float, default=STREAM_INTERVAL_MS,
                    help="--stream-interval-ms of the mode comparison and the goals (default: the server's)")
    ap.add_argument("--intervals", default="0,10,50", help="colocated --stream-interval-ms sweep ('' for none)")
    ap.add_argument("--bytes-prompts", type=_ints, default=[256, 8192], help="prompt lengths of the message sizes")
    ap.add_argument("--bytes-requests", type=int, default=8, help="requests run together for the message sizes")
    ap.add_argument("--offline-threads", type=int, default=1, help="torch threads of the offline engine, and "
                    "the server's --replica-cpus unless --server-args names one (Ray sets a replica's "
                    "OMP_NUM_THREADS to its CPUs)")
    ap.add_argument("--idle-s", type=float, default=30.0, help="idle window per server before its loads "
                    "(CPU per minute by role with no requests; 0 skips)")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--skip-bytes", action="store_true")
    ap.add_argument("--server-args", default="", help="extra `pdserve serve` flags in one string")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="on a GPU: the fraction each engine takes, the offline ones in this process and "
                         "every server replica's alike (they share the card; the engine's 0.9 fits "
                         "one): with --modes pd up to five engines, and the server's P/D replicas "
                         "need --server-args='--replica-gpus 0.5' on one GPU")
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
    configs = [("colocated", iv) for iv in sorted({*args.intervals, args.interval_ms})] if "colocated" in args.modes else []
    configs += [("pd", args.interval_ms)] if "pd" in args.modes else []
    sizes = [] if args.skip_bytes else run_message_sizes(args)
    bench = Bench(args, model, configs)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="bench_server_cpu_")
    runs: list[ServerRun] = []
    for config in configs:
        try:
            runs += bench.server(config, log_dir)
        except BenchError as e:
            print(f"[{config[0]} {config[1]:g} ms] error: {e}", file=sys.stderr)
            return 2

    main_runs = [r for r in runs if r.interval_ms == args.interval_ms]
    sweep = [r for r in runs if r.mode == "colocated" and r.interval_ms in args.intervals]
    print(f"\n## CPU by role, at --stream-interval-ms {args.interval_ms:g}\n\n{role_table(main_runs)}")
    print(f"\n## Per hop\n\n{hop_table(main_runs)}")
    if sweep:
        print(f"\n## Colocated, by --stream-interval-ms\n\n{interval_table(sweep)}")
    if sizes:
        print(f"\n## Bytes per streamed message\n\n{bytes_table(sizes)}")
    if bench.idle:
        roles = sorted({role for per in bench.idle.values() for role in per})
        print("\n## Idle: CPU seconds per minute, no requests\n\n| role | " + " | ".join(bench.idle) + " |\n| --- |"
              + " --- |" * len(bench.idle) + "\n" + "\n".join(
                  f"| {role} | " + " | ".join(f"{per.get(role, 0.0):.2f}" for per in bench.idle.values()) + " |"
                  for role in roles))
    print("\n## Goals\n\n" + "\n".join(goal_lines(main_runs, sizes)))
    print("\nCPU of other processes during the kept windows (server / offline), the load generator's, and "
          "server processes that exited in the window:\n" + "\n".join(
              f"  {r.label} {r.interval_ms:g} ms: {r.others_cpu_s:.1f} / "
              f"{r.offline.others_cpu_s if r.offline else 0.0:.1f} s, client {r.client_cpu_s:.1f} s, "
              f"{r.exited} exited" for r in runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "model": model, "runs": [dataclasses.asdict(r) for r in runs],
                       "idle_cpu_s_per_min": bench.idle,
                       "message_sizes": [{"prompt_tokens": s.prompt_tokens, "mean_bytes": s.mean_bytes,
                                          "steady_bytes": s.steady_bytes,
                                          "request_output_bytes": s.mean_request_output_bytes} for s in sizes]},
                      f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
