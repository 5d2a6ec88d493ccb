"""Per-request records and their summary: latency percentiles, throughput, goodput."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    ok: bool = False
    prompt_words: int = 0
    max_tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0  # stream chunks carrying choices (text or not)
    start_s: float = 0.0  # send time, relative to the start of the run
    usage_missing: bool = False  # no usage chunk: completion_tokens counts text chunks instead
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tpot_s"] = self.tpot_s
        return d


def percentile(values, q: float) -> float | None:
    """q-th percentile (0..100) with linear interpolation between closest ranks; None if empty."""
    xs = sorted(values)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


PERCENTILES = (50, 90, 99)


def _stats_ms(values_s) -> dict:
    ms = [v * 1e3 for v in values_s]
    out = {"mean": sum(ms) / len(ms) if ms else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(ms, q)
    return out


def meets_slo(rec: RequestRecord, slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
    """A successful request whose TTFT and TPOT are within the SLOs (TPOT of 1-token outputs
    is undefined and counts as met)."""
    if not rec.ok or rec.ttft_s is None or rec.ttft_s * 1e3 > slo_ttft_ms:
        return False
    tpot = rec.tpot_s
    return tpot is None or tpot * 1e3 <= slo_tpot_ms


def summarise(records, slo_ttft_ms: float, slo_tpot_ms: float, duration_s: float) -> dict:
    """Latency percentiles (ms), throughputs and goodput of one run's per-request records.

    Latencies come from successful requests; ITL pools every gap of every request. Throughputs
    count successful requests and their completion tokens over duration_s; goodput counts the
    requests meeting both SLOs, and slo_attainment is their fraction of all requests.
    """
    records = list(records)
    ok = [r for r in records if r.ok]
    good = [r for r in records if meets_slo(r, slo_ttft_ms, slo_tpot_ms)]

    def per_s(n: int) -> float | None:
        return n / duration_s if duration_s > 0 else None

    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    errors = Counter(r.error or "unknown error" for r in records if not r.ok)
    return {
        "requests": len(records),
        "successful": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(out_tokens),
        "ttft_ms": _stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": _stats_ms([g for r in ok for g in r.itl_s]),
        "tpot_ms": _stats_ms([t for t in (r.tpot_s for r in ok) if t is not None]),
        "e2e_ms": _stats_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "good_requests": len(good),
        "goodput": per_s(len(good)),
        "slo_attainment": len(good) / len(records) if records else None,
        "usage_missing": sum(r.usage_missing for r in ok),
        "errors": dict(errors.most_common()),
    }
