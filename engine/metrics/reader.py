"""Metric snapshots as `LLM.get_metrics()` returns them, in the shape of vLLM's metrics
reader: a flat list of Counter / Gauge / Histogram, each with its name and labels."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    name: str
    labels: dict[str, str]


@dataclass(frozen=True)
class Counter(Metric):
    """Monotonically increasing count (the name carries no `_total`)."""

    value: int


@dataclass(frozen=True)
class Gauge(Metric):
    value: float


@dataclass(frozen=True)
class Histogram(Metric):
    """`buckets` maps each upper bound, written as Prometheus writes `le` ("0.5", "+Inf"), to
    the cumulative count of observations at or below it; `count` equals buckets["+Inf"]."""

    buckets: dict[str, int]
    count: int
    sum: float


def bound_label(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))
