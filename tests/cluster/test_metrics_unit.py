"""cluster.metrics.AppMetrics: latency histograms, request/token counters and the per-replica
families built from Coordinator reports, read back through prometheus_client's parser."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import AppMetrics

BASE = {"model_name": "tiny", "mode": "pd"}

REPORTS = [
    {"role": "prefill", "replica": "p-1", "running": 3, "waiting": 2, "kv_usage": 0.25, "free_blocks": 90,
     "prefix_cache_hit_rate": 0.5,
     "kv_transfer": {"exports": 7, "loads": 0, "load_failures": 0, "bytes_out": 4096, "bytes_in": 0,
                     "load_seconds": 0.0}},
    {"role": "decode", "replica": "d-1", "running": 5, "waiting": 1, "kv_usage": 0.75, "free_blocks": 30,
     "prefix_cache_hit_rate": 0.125,
     "kv_transfer": {"exports": 0, "loads": 6, "load_failures": 1, "bytes_out": 0, "bytes_in": 3072,
                     "load_seconds": 1.5}},
]


def _parse(text: bytes) -> dict:
    """{family name: family} of an exposition text."""
    return {f.name: f for f in text_string_to_metric_families(text.decode())}


def _value(families, family: str, sample: str, **labels) -> float:
    matches = [s.value for s in families[family].samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (family, sample, labels, matches)
    return matches[0]


def _replica_labels(families, family: str) -> set[tuple[str, str]]:
    return {(s.labels["role"], s.labels["replica"]) for s in families[family].samples}


@pytest.fixture
def metrics() -> AppMetrics:
    return AppMetrics("tiny", "pd")


def test_histograms_count_sum_and_buckets(metrics):
    ttft = [0.02, 0.3, 4.0]
    itl = [0.004, 0.004, 0.02, 3.0]
    e2e = [1.2]
    for v in ttft:
        metrics.ttft.observe(v)
    for v in itl:
        metrics.itl.observe(v)
    for v in e2e:
        metrics.e2e.observe(v)
    fams = _parse(metrics.render([]))

    name = "pdserve_time_to_first_token_seconds"
    assert fams[name].type == "histogram"
    assert _value(fams, name, name + "_count", **BASE) == 3
    assert _value(fams, name, name + "_sum", **BASE) == pytest.approx(sum(ttft))
    assert _value(fams, name, name + "_bucket", le="0.025", **BASE) == 1
    assert _value(fams, name, name + "_bucket", le="0.25", **BASE) == 1
    assert _value(fams, name, name + "_bucket", le="0.5", **BASE) == 2
    assert _value(fams, name, name + "_bucket", le="2.5", **BASE) == 2
    assert _value(fams, name, name + "_bucket", le="5.0", **BASE) == 3
    assert _value(fams, name, name + "_bucket", le="+Inf", **BASE) == 3

    name = "pdserve_inter_token_latency_seconds"
    assert _value(fams, name, name + "_count", **BASE) == 4
    assert _value(fams, name, name + "_sum", **BASE) == pytest.approx(sum(itl))
    assert _value(fams, name, name + "_bucket", le="0.001", **BASE) == 0
    assert _value(fams, name, name + "_bucket", le="0.005", **BASE) == 2
    assert _value(fams, name, name + "_bucket", le="0.025", **BASE) == 3
    assert _value(fams, name, name + "_bucket", le="2.5", **BASE) == 3
    assert _value(fams, name, name + "_bucket", le="+Inf", **BASE) == 4

    name = "pdserve_e2e_request_latency_seconds"
    assert _value(fams, name, name + "_count", **BASE) == 1
    assert _value(fams, name, name + "_sum", **BASE) == pytest.approx(1.2)

    name = "pdserve_request_queue_time_seconds"
    assert _value(fams, name, name + "_count", **BASE) == 0
    assert _value(fams, name, name + "_sum", **BASE) == 0


def test_request_and_token_counters(metrics):
    metrics.request_done("ok", prompt_tokens=10, generated_tokens=5)
    metrics.request_done("ok", prompt_tokens=3, generated_tokens=2)
    metrics.request_done("error")
    fams = _parse(metrics.render([]))
    assert fams["pdserve_requests"].type == "counter"
    assert _value(fams, "pdserve_requests", "pdserve_requests_total", status="ok", **BASE) == 2
    assert _value(fams, "pdserve_requests", "pdserve_requests_total", status="error", **BASE) == 1
    assert _value(fams, "pdserve_prompt_tokens", "pdserve_prompt_tokens_total", **BASE) == 13
    assert _value(fams, "pdserve_generation_tokens", "pdserve_generation_tokens_total", **BASE) == 7


def test_registries_are_per_instance():
    a, b = AppMetrics("tiny", "pd"), AppMetrics("tiny", "pd")
    a.ttft.observe(0.1)
    fams = _parse(b.render([]))
    name = "pdserve_time_to_first_token_seconds"
    assert _value(fams, name, name + "_count", **BASE) == 0


GAUGES = {
    "pdserve_num_requests_running": "running",
    "pdserve_num_requests_waiting": "waiting",
    "pdserve_kv_cache_usage_ratio": "kv_usage",
    "pdserve_kv_cache_free_blocks": "free_blocks",
    "pdserve_prefix_cache_hit_rate": "prefix_cache_hit_rate",
}

TRANSFER = {
    "pdserve_kv_transfer_exports": "exports",
    "pdserve_kv_transfer_loads": "loads",
    "pdserve_kv_transfer_load_failures": "load_failures",
    "pdserve_kv_transfer_bytes_out": "bytes_out",
    "pdserve_kv_transfer_bytes_in": "bytes_in",
    "pdserve_kv_transfer_load_seconds": "load_seconds",
}


def test_replica_gauges_labelled_by_role_and_replica(metrics):
    fams = _parse(metrics.render(REPORTS))
    for name, key in GAUGES.items():
        assert fams[name].type == "gauge", name
        assert _replica_labels(fams, name) == {("prefill", "p-1"), ("decode", "d-1")}
        for r in REPORTS:
            assert _value(fams, name, name, role=r["role"], replica=r["replica"]) == pytest.approx(r[key])


def test_kv_transfer_counters(metrics):
    fams = _parse(metrics.render(REPORTS))
    for name, key in TRANSFER.items():
        assert fams[name].type == "counter", name
        assert _replica_labels(fams, name) == {("prefill", "p-1"), ("decode", "d-1")}
        for r in REPORTS:
            value = _value(fams, name, name + "_total", role=r["role"], replica=r["replica"])
            assert value == pytest.approx(r["kv_transfer"][key])


def test_missing_figures_read_as_zero(metrics):
    sparse = [{"role": "colocated", "replica": "c-1", "running": 2}]
    fams = _parse(metrics.render(sparse))
    assert _value(fams, "pdserve_num_requests_running", "pdserve_num_requests_running",
                  role="colocated", replica="c-1") == 2
    assert _value(fams, "pdserve_kv_cache_usage_ratio", "pdserve_kv_cache_usage_ratio",
                  role="colocated", replica="c-1") == 0
    assert _value(fams, "pdserve_kv_transfer_loads", "pdserve_kv_transfer_loads_total",
                  role="colocated", replica="c-1") == 0


def test_replica_missing_from_a_later_render_is_gone(metrics):
    fams = _parse(metrics.render(REPORTS))
    assert ("decode", "d-1") in _replica_labels(fams, "pdserve_num_requests_running")
    updated = [dict(REPORTS[0], running=9)]
    fams = _parse(metrics.render(updated))
    for name in list(GAUGES) + list(TRANSFER):
        assert _replica_labels(fams, name) == {("prefill", "p-1")}, name
    assert _value(fams, "pdserve_num_requests_running", "pdserve_num_requests_running",
                  role="prefill", replica="p-1") == 9
    fams = _parse(metrics.render([]))
    for name in list(GAUGES) + list(TRANSFER):
        assert name not in fams or not fams[name].samples, name
