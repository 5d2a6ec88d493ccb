"""Request metrics of several ingress replicas summed (cluster.control.metrics_merge): against one
registry that recorded every request itself (the oracle), and never decreasing between
scrapes whichever replica answers."""

from __future__ import annotations

import asyncio
import random

from prometheus_client.parser import text_string_to_metric_families

from cluster.control.coordinator import Coordinator
from cluster.control.metrics_merge import add
from cluster.http.metrics import AppMetrics


def _record(metrics: AppMetrics, rng: random.Random, n: int) -> None:
    for _ in range(n):
        status = rng.choice(["ok", "ok", "error", "cancelled"])
        metrics.ttft.observe(rng.uniform(0.001, 3.0))
        metrics.itl.observe(rng.uniform(0.001, 0.3))
        metrics.e2e.observe(rng.uniform(0.01, 30.0))
        if rng.random() < 0.3:
            metrics.local_prefill()
        metrics.request_done(status, rng.randint(1, 500), rng.randint(0, 200),
                             finished_reason=rng.choice(["stop", "length"]) if status == "ok" else None)


def _samples(text: bytes) -> dict:
    """{(sample name, labels): value}, without the creation times (they differ per registry)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples
            if not s.name.endswith("_created")}


def test_the_sum_of_replicas_equals_one_registry_that_saw_every_request(monkeypatch):
    from collections import Counter

    from cluster.replica import router_stats

    # Every registry here reads this process's routers' tally (one per ingress process in an
    # app): keep it empty, as the routers of these stand-in replicas never ran.
    monkeypatch.setattr(router_stats, "DECISIONS", Counter())
    replicas = [AppMetrics("m", "pd", max_model_len=512) for _ in range(3)]
    oracle = AppMetrics("m", "pd", max_model_len=512)
    for i, metrics in enumerate(replicas):
        _record(metrics, random.Random(i), 20 + 15 * i)
        _record(oracle, random.Random(i), 20 + 15 * i)  # the same requests, in one registry
    merged = _samples(replicas[0].render([], add(m.snapshot() for m in replicas)))
    expected = _samples(oracle.render([]))
    assert merged.keys() == expected.keys()
    for key, value in expected.items():
        assert abs(merged[key] - value) <= 1e-9 * max(1.0, abs(value)), key
    assert merged[("pdserve:requests_total", (("mode", "pd"), ("model_name", "m"), ("status", "ok")))] > 0


def test_counters_never_go_down_whichever_replica_answers_and_after_one_stops():
    coordinator = Coordinator("colocated", "t", control=object())
    a, b = AppMetrics("m", "colocated"), AppMetrics("m", "colocated")
    rng = random.Random(7)
    seen = -1.0
    key = ("vllm:e2e_request_latency_seconds_count", (("mode", "colocated"), ("model_name", "m")))

    async def run():
        nonlocal seen
        for step in range(12):
            live = [a] if step >= 8 else [a, b]  # b stops after step 7
            _record(rng.choice(live), rng, rng.randint(0, 3))
            answering = rng.choice(live)  # a scrape: its own fresh snapshot, the other's last one
            if rng.random() < 0.5:  # a periodic push of the other
                other = b if answering is a else a
                await coordinator.report_ingress_metrics("a" if other is a else "b", other.snapshot())
            replicas, requests = await coordinator.scrape("a" if answering is a else "b", answering.snapshot())
            now = _samples(answering.render(replicas, requests)).get(key, 0.0)
            assert now >= seen
            seen = now

    asyncio.run(run())
    b_count = _samples(b.render([])).get(key, 0.0)
    assert b_count > 0 and seen >= b_count  # the stopped replica's requests still count


def test_a_scrape_sums_every_ingress_replica_known_to_the_coordinator():
    coordinator = Coordinator("colocated", "t", control=object())
    a, b = AppMetrics("m", "colocated"), AppMetrics("m", "colocated")
    _record(a, random.Random(1), 4)
    _record(b, random.Random(2), 6)
    key = ("pdserve:requests_total", (("mode", "colocated"), ("model_name", "m"), ("status", "ok")))
    ok = sum(_samples(m.render([])).get(key, 0.0) for m in (a, b))

    async def run():
        replicas, requests = await coordinator.scrape("a", a.snapshot())
        assert replicas == [] and _samples(a.render(replicas, requests))[key] < ok  # b not heard of yet
        await coordinator.report_ingress_metrics("b", b.snapshot())
        _, requests = await coordinator.scrape("a", a.snapshot())
        assert _samples(a.render([], requests))[key] == ok
        assert sorted(coordinator.ingress_metrics) == ["a", "b"]

    asyncio.run(run())
