"""Prometheus metrics of the app, served by the ingress at `GET /metrics`.

Request latencies (TTFT, ITL, E2E, queue time) are observed where the client's request is
seen whole: the ingress. Engine figures (running/waiting, KV usage, prefix hit rate, KV
transfer counters) come from the Coordinator's board of replica reports, labelled by role and
replica, and are turned into metric families at scrape time. All text is produced by
prometheus_client.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

_GAUGES = (
    ("running", "pdserve_num_requests_running", "Requests in the engine's running set"),
    ("waiting", "pdserve_num_requests_waiting", "Requests waiting in the engine's queue"),
    ("kv_usage", "pdserve_kv_cache_usage_ratio", "Fraction of KV cache blocks in use"),
    ("free_blocks", "pdserve_kv_cache_free_blocks", "Free KV cache blocks"),
    ("prefix_cache_hit_rate", "pdserve_prefix_cache_hit_rate", "Prefix cache hit rate (tokens)"),
)
_TRANSFER_COUNTERS = (
    ("exports", "pdserve_kv_transfer_exports", "KV exports (prefill side)"),
    ("loads", "pdserve_kv_transfer_loads", "KV loads (decode side)"),
    ("load_failures", "pdserve_kv_transfer_load_failures", "KV loads that failed"),
    ("bytes_out", "pdserve_kv_transfer_bytes_out", "Bytes of KV exported"),
    ("bytes_in", "pdserve_kv_transfer_bytes_in", "Bytes of KV loaded"),
    ("load_seconds", "pdserve_kv_transfer_load_seconds", "Seconds spent loading KV (fetch to blocks written)"),
)


class _ReplicaFigures:
    """A collector over the latest replica reports (set just before each scrape)."""

    def __init__(self) -> None:
        self.reports: list[dict] = []

    def collect(self):
        labels = ["role", "replica"]
        for key, name, doc in _GAUGES:
            g = GaugeMetricFamily(name, doc, labels=labels)
            for r in self.reports:
                g.add_metric([r["role"], r["replica"]], float(r.get(key, 0)))
            yield g
        for key, name, doc in _TRANSFER_COUNTERS:
            c = CounterMetricFamily(name, doc, labels=labels)
            for r in self.reports:
                c.add_metric([r["role"], r["replica"]], float(r.get("kv_transfer", {}).get(key, 0)))
            yield c


class AppMetrics:
    def __init__(self, model_name: str, mode: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "mode"]
        self._labels = {"model_name": model_name, "mode": mode}

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, registry=self.registry, buckets=buckets).labels(**self._labels)

        self.ttft = hist("pdserve_time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.itl = hist("pdserve_inter_token_latency_seconds", "Time between streamed tokens", _ITL_BUCKETS)
        self.e2e = hist("pdserve_e2e_request_latency_seconds", "Request latency, arrival to last token",
                        _LATENCY_BUCKETS)
        self.queue = hist("pdserve_request_queue_time_seconds", "Time in the engine queue before first scheduled",
                          _LATENCY_BUCKETS)
        self._requests = Counter("pdserve_requests", "Requests answered, by status", labels + ["status"],
                                 registry=self.registry)
        self._prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens", labels,
                                      registry=self.registry).labels(**self._labels)
        self._generation_tokens = Counter("pdserve_generation_tokens", "Generated tokens", labels,
                                          registry=self.registry).labels(**self._labels)
        self._replicas = _ReplicaFigures()
        self.registry.register(self._replicas)

    def request_done(self, status: str, prompt_tokens: int = 0, generated_tokens: int = 0) -> None:
        self._requests.labels(**self._labels, status=status).inc()
        self._prompt_tokens.inc(prompt_tokens)
        self._generation_tokens.inc(generated_tokens)

    def render(self, replica_reports: list[dict]) -> bytes:
        self._replicas.reports = replica_reports
        return generate_latest(self.registry)
