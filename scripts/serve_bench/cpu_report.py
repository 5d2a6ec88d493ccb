"""bench_server_cpu.py's figures: CPU per output token by role next to the offline engine's,
per-hop costs, the stream-interval sweep, message sizes, and the CPU goals as PASS/FAIL
lines. Tables are Markdown, so they paste into docs/benchmarks.md as printed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scripts.serve_bench.offline import MessageSizes, OfflineRun
from scripts.serve_bench.proc_cpu import ROLE_GROUPS, group_seconds

# The serving layer's CPU goals on the small model (docs/benchmarks.md#server-cpu-per-output-token).
WHOLE_OVER_OFFLINE = {"colocated": 1.25, "pd": 1.4}
OUTSIDE_ENGINE_MS = {8: 0.5, 64: 0.2}
SAME_SIZE_TOLERANCE = 0.10  # bytes/message "independent of prompt length": within 10%


@dataclass
class ServerRun:
    mode: str
    concurrency: int
    interval_ms: float
    summary: dict  # scripts.serve_bench.records.summarise of the measured requests
    role_seconds: dict[str, float]  # CPU seconds per role over the measured window
    exited: int  # server processes that exited during the window (their last CPU is lost)
    client_cpu_s: float  # this process (the load generator): not the server's
    sse_chunks: int  # text chunks the clients received
    others_cpu_s: float = 0.0  # every other process on the machine in the window (noise)
    offline: OfflineRun | None = None  # the offline engine on the same prompts, just before
    # P/D runs: a prefill and a decode engine offline on the same prompts (no serving layer):
    # what disaggregation itself costs, the floor of a P/D server.
    offline_pd: OfflineRun | None = None
    # Forward passes of each engine role over the window (pdserve:engine_steps): fewer rows
    # per step than offline means more steps, each paying for the weights, for the same tokens.
    engine_steps: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{'P/D' if self.mode == 'pd' else self.mode} c{self.concurrency}"

    @property
    def tokens(self) -> int:
        return self.summary["output_tokens"]

    def ms(self, seconds: float) -> float:
        return 1e3 * seconds / self.tokens if self.tokens else math.nan

    @property
    def whole_s(self) -> float:
        return sum(self.role_seconds.values())

    @property
    def engine_s(self) -> float:
        return group_seconds(self.role_seconds).get("engine", 0.0)

    @property
    def outside_s(self) -> float:
        return self.whole_s - self.engine_s


def _f(v, spec: str = ".2f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def role_table(runs: list[ServerRun]) -> str:
    """CPU ms per output token of each role (CPU seconds in brackets), one column per run,
    and the offline engine's on the same requests below."""
    roles = [r for r in ROLE_GROUPS if any(r in run.role_seconds for run in runs)]
    rows = [[role] + [f"{_f(run.ms(run.role_seconds[role]))} ({_f(run.role_seconds[role], '.1f')} s)"
                      if role in run.role_seconds else "-" for run in runs] for role in roles]

    def row(name, values, spec=".2f"):
        rows.append([f"**{name}**"] + [_f(v, spec) for v in values])

    def off(run, attr):
        return getattr(run.offline, attr) if run.offline is not None else None

    row("whole server", [run.ms(run.whole_s) for run in runs])
    row("outside the engines", [run.ms(run.outside_s) for run in runs])
    row("offline engine", [off(run, "cpu_ms_per_token") for run in runs])
    row("whole / offline", [_ratio(run.ms(run.whole_s), off(run, "cpu_ms_per_token") or 0) for run in runs])
    row("HTTP tok/s", [run.summary["output_throughput"] for run in runs], ".0f")
    row("offline tok/s", [off(run, "tok_s") for run in runs], ".0f")
    row("HTTP / offline tok/s", [_ratio(run.summary["output_throughput"] or 0, off(run, "tok_s") or 0)
                                 for run in runs])
    if any(run.offline_pd is not None for run in runs):
        pd = [run.offline_pd.cpu_ms_per_token if run.offline_pd is not None else None for run in runs]
        row("offline P/D engines", pd)
        row("offline P/D / offline", [_ratio(p, off(run, "cpu_ms_per_token") or 0) if p else None
                                      for p, run in zip(pd, runs)])
        row("whole / offline P/D", [_ratio(run.ms(run.whole_s), p) if p else None for p, run in zip(pd, runs)])
    return _table(["CPU ms / output token"] + [run.label for run in runs], rows)


def hop_table(runs: list[ServerRun]) -> str:
    """What each hop costs per output token. proxy -> ingress: one SSE chunk per token and
    request (Serve ships it as at least one streamed item, the proxy's CPU pays for it);
    ingress -> replica: one message per engine step (the offline engine's steps on the same
    requests), the engine replica's CPU beyond the offline engine's pays for it."""
    rows = []
    for run in runs:
        o = run.offline
        proxy = run.role_seconds.get("proxy", 0.0)
        ingress = run.role_seconds.get("ingress", 0.0)
        excess_ms = run.ms(run.engine_s) - o.cpu_ms_per_token if o else math.nan
        step_msgs = o.steps / o.output_tokens if o and run.interval_ms == 0 else math.nan
        rows.append([run.label, _f(run.sse_chunks / run.tokens if run.tokens else math.nan),
                     _f(run.ms(proxy)), _f(1e6 * proxy / run.sse_chunks if run.sse_chunks else math.nan, ".0f"),
                     _f(run.ms(ingress)), _f(step_msgs, ".3f"), _f(excess_ms), steps_cell(run)])
    return _table(["run", "SSE chunks / token", "proxy ms / token", "proxy µs / chunk",
                   "ingress ms / token", "replica messages / token", "engine replica - offline ms / token",
                   "engine steps served / offline"], rows)


def steps_cell(run: ServerRun) -> str:
    """The served engines' forward passes (by role when several) against the offline
    engine's on the same requests, e.g. "337 / 264" or "decode 831 + prefill 51 / 769"."""
    if not run.engine_steps:
        return "-"
    if len(run.engine_steps) == 1:
        served = f"{next(iter(run.engine_steps.values())):.0f}"
    else:
        served = " + ".join(f"{role} {n:.0f}" for role, n in sorted(run.engine_steps.items()))
    return f"{served} / {run.offline.forward_steps}" if run.offline else served


def interval_table(runs: list[ServerRun]) -> str:
    rows = []
    for run in sorted(runs, key=lambda r: (r.concurrency, r.interval_ms)):
        s = run.summary
        rows.append([f"c{run.concurrency}", _f(run.interval_ms, "g"), _f(run.ms(run.whole_s)),
                     _f(run.ms(run.outside_s)), _f(run.ms(run.engine_s)),
                     _f(s["ttft_ms"]["p50"], ".0f"), _f(s["itl_ms"]["p50"], ".1f"), _f(s["tpot_ms"]["p50"], ".1f"),
                     _f(run.tokens / run.sse_chunks if run.sse_chunks else math.nan),
                     _f(s["output_throughput"], ".0f")])
    return _table(["load", "interval ms", "whole ms/tok", "outside engines ms/tok", "engines ms/tok",
                   "TTFT p50 ms", "ITL p50 ms", "TPOT p50 ms", "tokens / chunk", "tok/s"], rows)


def bytes_table(sizes: list[MessageSizes]) -> str:
    rows = [[str(s.prompt_tokens), str(len(s.messages)), _f(s.deltas_per_message, ".1f"), _f(s.mean_bytes, ".0f"),
             _f(s.steady_bytes, ".0f"), _f(s.steady_bytes / s.requests if s.steady_bytes else None, ".0f"),
             str(max(m.nbytes for m in s.messages)), _f(s.mean_request_output_bytes, ".0f")] for s in sizes]
    return _table(["prompt tokens", "messages", "deltas / message", "bytes / message (mean)",
                   f"bytes / full-batch decode message ({sizes[0].requests} deltas)", "bytes / delta",
                   "largest message", "RequestOutput bytes (old per-token unit)"], rows)


def goal_lines(runs: list[ServerRun], sizes: list[MessageSizes]) -> list[str]:
    """One PASS/FAIL line per goal and run (a run without a baseline or a goal is skipped)."""
    out = []
    for run in runs:
        o = run.offline
        bound = WHOLE_OVER_OFFLINE.get(run.mode)
        if o is not None and bound is not None:
            ratio = _ratio(run.ms(run.whole_s), o.cpu_ms_per_token)
            out.append(f"{'PASS' if ratio <= bound else 'FAIL'}: {run.label}: whole-server CPU "
                       f"{run.ms(run.whole_s):.2f} ms/token = {ratio:.2f}x offline "
                       f"({o.cpu_ms_per_token:.2f}); goal <= {bound}x")
        limit = OUTSIDE_ENGINE_MS.get(run.concurrency)
        if limit is not None:
            v = run.ms(run.outside_s)
            out.append(f"{'PASS' if v <= limit else 'FAIL'}: {run.label}: CPU outside the engines "
                       f"{v:.2f} ms/token; goal <= {limit}")
    if len(sizes) >= 2 and all(s.steady_bytes for s in sizes):
        short, long = sizes[0], sizes[-1]
        change = long.steady_bytes / short.steady_bytes - 1
        out.append(f"{'PASS' if abs(change) <= SAME_SIZE_TOLERANCE else 'FAIL'}: bytes per message "
                   f"{short.steady_bytes:.0f} at {short.prompt_tokens} prompt tokens, {long.steady_bytes:.0f} "
                   f"at {long.prompt_tokens} ({change:+.1%}); goal: independent of prompt length "
                   f"(within {SAME_SIZE_TOLERANCE:.0%})")
    return out
