"""Request metrics summed over several ingress replicas (`--api-server-count`).

A Prometheus scrape reaches one ingress replica (whichever the load balancer picks), yet
must show the whole app's counters and histograms, as vLLM's API servers share theirs through
prometheus_client's multiprocess mode. Here each ingress sends a `Snapshot` of its own
registry (plain data: it crosses Ray) to the Coordinator, which keeps the latest of each; a
scrape stores its own fresh snapshot there and renders the sum of all.

Counters must never go down between scrapes, whichever replica answers them (Prometheus reads
a decrease as a restart, i.e. a spike of the whole total). Each stored snapshot only grows (a
replica's later snapshot replaces its earlier one), and that of a replica that stopped stays
(it was one of the totals), so the sum only grows too.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

# (family name, type, documentation, ((sample name, ((label, value), ...), value), ...))
Family = tuple[str, str, str, tuple[tuple[str, tuple[tuple[str, str], ...], float], ...]]
Snapshot = tuple[Family, ...]


def snapshot_of(registry: CollectorRegistry) -> Snapshot:
    return tuple(
        (m.name, m.type, m.documentation,
         tuple((s.name, tuple(sorted(s.labels.items())), float(s.value)) for s in m.samples))
        for m in registry.collect())


def add(snapshots: Iterable[Snapshot]) -> Snapshot:
    """Sample-wise sums (`_created`: the earliest), families in first-seen order."""
    families: dict[str, tuple[str, str, dict]] = {}
    for snap in snapshots:
        for name, kind, doc, samples in snap:
            _, _, values = families.setdefault(name, (kind, doc, {}))
            for sample, labels, value in samples:
                key = (sample, labels)
                if key not in values:
                    values[key] = value
                elif sample.endswith("_created"):
                    values[key] = min(values[key], value)
                else:
                    values[key] += value
    return tuple((name, kind, doc, tuple((s, labels, v) for (s, labels), v in values.items()))
                 for name, (kind, doc, values) in families.items())


class SnapshotCollector:
    """A prometheus_client collector that yields a Snapshot's families."""

    def __init__(self, snapshot: Snapshot = ()) -> None:
        self.snapshot = snapshot

    def collect(self):
        for name, kind, doc, samples in self.snapshot:
            family = Metric(name, doc, kind)
            for sample, labels, value in samples:
                family.add_sample(sample, dict(labels), value)
            yield family
