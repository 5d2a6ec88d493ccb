"""Prometheus metrics of the app, served by the ingress at `GET /metrics`.

Names follow vLLM wherever vLLM has the metric (`vllm:time_to_first_token_seconds`,
`vllm:num_requests_running`, ...; defined once in engine.metrics.names, which the offline
`LLM.get_metrics()` uses too), so vLLM's dashboards work unchanged; figures only pdserve has
(KV transfer, request status, replicas per role, autoscaling signals) are `pdserve:`.

Request latencies (TTFT, ITL, E2E, queue time) are observed where the client's request is
seen whole: the ingress; with several ingress replicas a scrape shows their sum
(cluster.control.metrics_merge). Engine figures come from the Coordinator's board of replica reports,
labelled by role and replica, and are turned into metric families at scrape time. All text is
produced by prometheus_client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cluster.control.metrics_merge import Snapshot, SnapshotCollector, snapshot_of
from cluster.http.errors import OpenAIError
from cluster.http.migration import MIGRATION_REASONS
from cluster.pd.placement import FALLBACK_REASONS
from cluster.replica import router_stats
from cluster.report import ReplicaReport
from engine.metrics import names
from engine.metrics.names import MetricDef
from kvstore.kv_io import REFUSAL_REASONS, refusal_key

logger = logging.getLogger(__name__)
# Token-count histogram bounds when the ingress does not say its context length.
DEFAULT_MAX_MODEL_LEN = 1 << 20

REQUESTS = MetricDef("pdserve:requests", "counter", "Requests answered, by status (ok, error, cancelled)")
LOCAL_PREFILLS = MetricDef("pdserve:local_prefills", "counter",
                           "P/D prompts prefilled on their decode replica (conditional disaggregation)")
PD_FALLBACKS = MetricDef("pdserve:pd_fallback", "counter",
                         "P/D prompts prefilled on their decode replica because no prefill replica could take "
                         "them soon, by reason (decode-only fallback)")
MIGRATIONS = MetricDef("pdserve:request_migrations", "counter",
                       "Requests that went on on another engine replica because theirs died or hung, by reason "
                       "(decode migration)")
ROUTER_DECISIONS = MetricDef("pdserve:router_decisions", "counter",
                             "Replicas chosen by this ingress's request routers, by deployment and reason "
                             "(kv_overlap, load, prefix_affinity, lora, round_robin)")
KV_CACHED_BLOCKS = MetricDef("pdserve:kv_cached_blocks", "gauge",
                             "Prefix blocks a replica's engine holds, by medium (KV events on)")
REPLICAS = MetricDef("pdserve:replicas", "gauge", "Engine replicas reporting, by role")
# Keys of a replica report's "kv_transfer" dict.
KV_TRANSFER: dict[str, MetricDef] = {
    "exports": MetricDef("pdserve:kv_transfer_exports", "counter", "KV exports (prefill side)"),
    "loads": MetricDef("pdserve:kv_transfer_loads", "counter", "KV loads (decode side)"),
    "load_failures": MetricDef("pdserve:kv_transfer_load_failures", "counter", "KV loads that failed"),
    "bytes_out": MetricDef("pdserve:kv_transfer_bytes_out", "counter", "Bytes of KV exported"),
    "bytes_in": MetricDef("pdserve:kv_transfer_bytes_in", "counter", "Bytes of KV loaded"),
    "load_seconds": MetricDef("pdserve:kv_transfer_load_seconds", "counter",
                              "Seconds spent loading KV (fetch to blocks written)"),
    # The host KV tier's (engine.kv_offload; --kv-offloading-size).
    "host_stores": MetricDef("pdserve:kv_offload_stores", "counter", "Blocks copied to the host KV tier"),
    "host_loads": MetricDef("pdserve:kv_offload_loads", "counter", "Blocks loaded from the host KV tier"),
    "host_hit_tokens": MetricDef("pdserve:kv_offload_hit_tokens", "counter",
                                 "Prompt tokens loaded from the host KV tier instead of computed"),
    "host_refused": MetricDef("pdserve:kv_offload_refused", "counter",
                              "Host-tier loads refused (checksum, shape or dtype) and recomputed"),
    "host_bytes_held": MetricDef("pdserve:kv_offload_bytes_held", "gauge", "Bytes the host KV tier holds"),
}
# The replica's own latency percentiles the autoscaler reads; absent until it has samples.
SCALING_SIGNALS: dict[str, MetricDef] = {
    "ttft_p90_s": MetricDef("pdserve:replica_ttft_p90_seconds", "gauge",
                            "A replica's recent time-to-first-token p90 (autoscaling signal)"),
    "itl_p90_s": MetricDef("pdserve:replica_itl_p90_seconds", "gauge",
                           "A replica's recent inter-token latency p90 (autoscaling signal)"),
}


class _RouterDecisions:
    """The routers of this process (cluster.replica.router_stats), read at collection."""

    def __init__(self, labels: dict[str, str]) -> None:
        self._labels = labels

    def collect(self):
        family = _family(ROUTER_DECISIONS, [*self._labels, "deployment", "reason"])
        for (deployment, reason), n in sorted(router_stats.DECISIONS.items()):
            family.add_metric([*self._labels.values(), deployment, reason], n)
        yield family


def _family(definition: MetricDef, labels: list[str]):
    cls = CounterMetricFamily if definition.kind == "counter" else GaugeMetricFamily
    return cls(definition.name, definition.doc, labels=labels)


class _ReplicaFigures:
    """A collector over the latest replica reports (set just before each scrape)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.reports: list[ReplicaReport] = []

    def collect(self):
        labels = ["model_name", "role", "replica"]
        # Flat figures keyed as the metric tables are: the engine's, then the replica's own.
        flat = [(r, {**r.engine.figures(), "ttft_p90_s": r.ttft_p90_s, "itl_p90_s": r.itl_p90_s})
                for r in self.reports]

        def families(table: dict[str, MetricDef], figures_of):
            for key, definition in table.items():
                family = _family(definition, labels)
                for r, figures in flat:
                    value = figures_of(r, figures).get(key, 0)
                    if value is not None:
                        family.add_metric([self.model_name, str(r.role), r.replica], float(value))
                yield family

        yield from families(names.ENGINE_FIGURES, lambda r, f: f)
        yield from families(KV_TRANSFER, lambda r, f: r.kv_transfer)
        refused = _family(names.KV_TRANSFER_REFUSED, [*labels, "reason"])
        for r in self.reports:
            for reason in REFUSAL_REASONS:
                refused.add_metric([self.model_name, str(r.role), r.replica, reason],
                                   float(r.kv_transfer.get(refusal_key(reason), 0)))
        yield refused
        # Only replicas that speculate report these (a prefill replica never does).
        yield from families(names.SPEC_DECODE_FIGURES,
                            lambda r, f: {k: f.get(k) for k in names.SPEC_DECODE_FIGURES})
        per_pos = _family(names.SPEC_DECODE_PER_POS, [*labels, "position"])
        for r, figures in flat:
            for pos, n in enumerate(figures.get(names.SPEC_DECODE_PER_POS_KEY, ())):
                per_pos.add_metric([self.model_name, str(r.role), r.replica, str(pos)], float(n))
        yield per_pos
        for key, definition in names.DP_FIGURES.items():
            family = _family(definition, [*labels, "engine"])
            for r, figures in flat:
                for core in figures.get(names.DP_KEY, ()):
                    family.add_metric([self.model_name, str(r.role), r.replica, str(core["rank"])], float(core[key]))
            yield family
        yield from families(SCALING_SIGNALS, lambda r, f: {k: f.get(k) for k in SCALING_SIGNALS})
        lora_keys = ["running_lora_adapters", "waiting_lora_adapters", "max_lora"]
        lora = _family(names.LORA_REQUESTS_INFO, [*labels, *lora_keys])
        for r, figures in flat:
            if names.LORA_KEY in figures:
                info = names.lora_info_labels(figures[names.LORA_KEY])
                lora.add_metric([self.model_name, str(r.role), r.replica, *(info[k] for k in lora_keys)], time.time())
        yield lora
        cached = _family(KV_CACHED_BLOCKS, [*labels, "medium"])
        for r in self.reports:
            for medium, n in sorted(r.kv_cached_blocks.items()):
                cached.add_metric([self.model_name, str(r.role), r.replica, medium], float(n))
        yield cached
        replicas = _family(REPLICAS, ["model_name", "role"])
        for role, n in sorted(Tally(str(r.role) for r in self.reports).items()):
            replicas.add_metric([self.model_name, role], n)
        yield replicas


class AppMetrics:
    """The ingress's metrics. `max_model_len` bounds the token-count histograms (vLLM's
    1-2-5 buckets up to the context length)."""

    def __init__(self, model_name: str, mode: str, max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "mode"]
        self._labels = {"model_name": model_name, "mode": mode}

        def hist(definition: MetricDef):
            return Histogram(definition.name, definition.doc, labels, registry=self.registry,
                             buckets=definition.buckets).labels(**self._labels)

        def counter(definition: MetricDef, extra: tuple[str, ...] = ()):
            return Counter(definition.name, definition.doc, labels + list(extra), registry=self.registry)

        self.ttft = hist(names.TIME_TO_FIRST_TOKEN)
        self.itl = hist(names.INTER_TOKEN_LATENCY)
        self.e2e = hist(names.E2E_REQUEST_LATENCY)
        self.queue = hist(names.REQUEST_QUEUE_TIME)
        self._prompt_len = hist(names.request_prompt_tokens(max_model_len))
        self._generation_len = hist(names.request_generation_tokens(max_model_len))
        self._prompt_tokens = counter(names.PROMPT_TOKENS).labels(**self._labels)
        self._generation_tokens = counter(names.GENERATION_TOKENS).labels(**self._labels)
        self._success = counter(names.REQUEST_SUCCESS, ("finished_reason",))
        self._requests = counter(REQUESTS, ("status",))
        self._local_prefills = counter(LOCAL_PREFILLS).labels(**self._labels)
        self._fallbacks = counter(PD_FALLBACKS, ("reason",))
        if mode == "pd":
            for reason in FALLBACK_REASONS:  # every reason shows, at 0 until it happens
                self._fallbacks.labels(**self._labels, reason=reason)
        self._migrations = counter(MIGRATIONS, ("reason",))
        for reason in MIGRATION_REASONS:
            self._migrations.labels(**self._labels, reason=reason)
        self.registry.register(_RouterDecisions(self._labels))
        self.answered = 0  # requests recorded (tells the ingress its snapshot changed)
        # What a scrape renders: the request metrics of every ingress replica, then the engines'.
        self._requests_of_all = SnapshotCollector()
        self._replicas = _ReplicaFigures(model_name)
        self._scrape = CollectorRegistry()
        self._scrape.register(self._requests_of_all)
        self._scrape.register(self._replicas)

    def request_done(self, status: str, prompt_tokens: int, generated_tokens: int,
                     finished_reason: str | None = None) -> None:
        """One request answered: `status` ok / error / cancelled; `finished_reason` (stop,
        length, ...) when the engine finished it, which is what vLLM counts as a success."""
        self.answered += 1
        self._requests.labels(**self._labels, status=status).inc()
        self._prompt_tokens.inc(prompt_tokens)
        self._generation_tokens.inc(generated_tokens)
        if finished_reason is not None:
            self._success.labels(**self._labels, finished_reason=finished_reason).inc()
            self._prompt_len.observe(prompt_tokens)
            self._generation_len.observe(generated_tokens)

    def local_prefill(self) -> None:
        self._local_prefills.inc()

    def pd_fallback(self, reason: str) -> None:
        self._fallbacks.labels(**self._labels, reason=reason).inc()

    def request_migration(self, reason: str) -> None:
        self._migrations.labels(**self._labels, reason=reason).inc()

    def snapshot(self) -> Snapshot:
        """This replica's request metrics, as plain data (cluster.control.metrics_merge)."""
        return snapshot_of(self.registry)

    def render(self, replica_reports: list[ReplicaReport], requests: Snapshot | None = None) -> bytes:
        """The exposition text: `requests` (the request metrics of all ingress replicas,
        summed; default: this one's) and the engine replicas' figures."""
        self._requests_of_all.snapshot = self.snapshot() if requests is None else requests
        self._replicas.reports = replica_reports
        return generate_latest(self._scrape)


# How often an ingress replica whose request metrics changed sends them to the Coordinator
# (a scrape of another replica shows them that stale at most; its own are always fresh). No
# hand-over when a replica stops: Serve stops the Coordinator with the app, and a call to it
# then waits out its bound, which would add that to every shutdown; a replaced replica's
# requests of its last period are the only ones not counted.
METRICS_PUSH_S = 2.0


async def push_forever(metrics: AppMetrics, send, period_s: float = METRICS_PUSH_S) -> None:
    """An ingress's request metrics to the Coordinator (cluster.control.metrics_merge), with
    `send(snapshot)`, each period in which they changed."""
    sent = 0
    while True:
        await asyncio.sleep(period_s)  # a period, not a wait on an event
        if metrics.answered != sent:
            sent = metrics.answered
            try:
                await send(metrics.snapshot())
            except OpenAIError as e:  # a restarting coordinator: sent again at the next period
                sent = -1
                logger.debug("request metrics not sent: %s", e.message)
