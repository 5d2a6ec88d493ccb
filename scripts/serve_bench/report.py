"""Text report of a run's summary, and the P/D / colocated ratios."""

from __future__ import annotations

import math

from scripts.serve_bench.records import PERCENTILES


def _fmt(v, spec: str = ".1f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def format_summary(title: str, s: dict) -> str:
    lines = [f"== {title}: {s['requests']} requests ({s['successful']} ok, {s['failed']} failed) "
             f"in {_fmt(s['duration_s'], '.2f')} s",
             f"{'(ms)':<8} {'mean':>9} " + " ".join(f"{'p' + str(q):>9}" for q in PERCENTILES)]
    for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")):
        st = s[key]
        lines.append(f"{name:<8} {_fmt(st['mean']):>9} "
                     + " ".join(f"{_fmt(st[f'p{q}']):>9}" for q in PERCENTILES))
    slo = s["slo"]
    att = s["slo_attainment"]
    lines += [
        f"request throughput  {_fmt(s['request_throughput'], '.2f')} req/s",
        f"output throughput   {_fmt(s['output_throughput'], '.1f')} tok/s "
        f"({s['output_tokens']} output, {s['input_tokens']} prompt tokens)",
        f"goodput             {_fmt(s['goodput'], '.2f')} req/s: {s['good_requests']}/{s['requests']} "
        f"({_fmt(att * 100 if att is not None else None, '.1f')}%) met TTFT <= {slo['ttft_ms']:g} ms "
        f"and TPOT <= {slo['tpot_ms']:g} ms",
    ]
    if s["usage_missing"]:
        lines.append(f"note: {s['usage_missing']} responses had no usage chunk; their tokens are "
                     f"counted as text chunks")
    if s["errors"]:
        lines.append("failures:")
        lines += [f"  {n:>5} x {msg}" for msg, n in s["errors"].items()]
    return "\n".join(lines)


def _ratio(a, b) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


RATIO_KEYS = (("TTFT p50", ("ttft_ms", "p50")), ("TTFT p99", ("ttft_ms", "p99")),
              ("ITL p50", ("itl_ms", "p50")), ("req/s", ("request_throughput",)),
              ("tok/s", ("output_throughput",)), ("goodput", ("goodput",)))


def compare_ratios(pd: dict, colocated: dict) -> dict:
    """P/D / colocated for the headline metrics (None where undefined)."""
    def get(s, path):
        for k in path:
            s = s[k]
        return s
    return {name: _ratio(get(pd, path), get(colocated, path)) for name, path in RATIO_KEYS}


def format_ratios(ratios: dict) -> str:
    return "P/D / colocated: " + ", ".join(
        f"{k} {'x' + _fmt(v, '.2f') if v is not None else 'n/a'}" for k, v in ratios.items())
