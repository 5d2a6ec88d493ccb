"""cluster.http.metrics.AppMetrics: latency histograms, request/token counters and the per-replica
families built from Coordinator reports, read back through prometheus_client's parser."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.http.metrics import AppMetrics
from cluster.report import ReplicaReport
from cluster.roles import Role
from engine.load import EngineLoad

BASE = {"model_name": "tiny", "mode": "pd"}

def _report(role: str, replica: str, *, ttft_p90_s=None, itl_p90_s=None, kv_transfer=None, **engine) -> ReplicaReport:
    return ReplicaReport(replica, Role.of(role), EngineLoad(**engine), kv_transfer=kv_transfer or {},
                         ttft_p90_s=ttft_p90_s, itl_p90_s=itl_p90_s)


REPORTS = [
    _report("prefill", "p-1", running=3, waiting=2, free_blocks=90, total_blocks=120, prefix_cache_queries=400,
            prefix_cache_hits=200, num_preemptions=0, ttft_p90_s=0.3,
            kv_transfer={"exports": 7, "loads": 0, "load_failures": 0, "bytes_out": 4096, "bytes_in": 0,
                         "load_seconds": 0.0}),
    _report("decode", "d-1", running=5, waiting=1, free_blocks=30, total_blocks=120, prefix_cache_queries=64,
            prefix_cache_hits=8, num_preemptions=2, itl_p90_s=0.05,
            kv_transfer={"exports": 0, "loads": 6, "load_failures": 1, "bytes_out": 0, "bytes_in": 3072,
                         "load_seconds": 1.5}),
]


def _figure(r: ReplicaReport, key: str) -> float:
    """A report's figure by the metric tables' key (kv_usage 0.25 and 0.75, hit rates 0.5 and 0.125 above)."""
    return {**r.engine.figures(), "ttft_p90_s": r.ttft_p90_s, "itl_p90_s": r.itl_p90_s}[key]


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

    # Bucket bounds are vLLM's, so its dashboards' quantiles read the same.
    name = "vllm:time_to_first_token_seconds"
    assert fams[name].type == "histogram"
    assert _value(fams, name, name + "_count", **BASE) == 3
    assert _value(fams, name, name + "_sum", **BASE) == pytest.approx(sum(ttft))
    assert _value(fams, name, name + "_bucket", le="0.01", **BASE) == 0
    assert _value(fams, name, name + "_bucket", le="0.02", **BASE) == 1
    assert _value(fams, name, name + "_bucket", le="0.25", **BASE) == 1
    assert _value(fams, name, name + "_bucket", le="0.5", **BASE) == 2
    assert _value(fams, name, name + "_bucket", le="2.5", **BASE) == 2
    assert _value(fams, name, name + "_bucket", le="5.0", **BASE) == 3
    assert _value(fams, name, name + "_bucket", le="2560.0", **BASE) == 3
    assert _value(fams, name, name + "_bucket", le="+Inf", **BASE) == 3

    name = "vllm:inter_token_latency_seconds"
    assert _value(fams, name, name + "_count", **BASE) == 4
    assert _value(fams, name, name + "_sum", **BASE) == pytest.approx(sum(itl))
    assert _value(fams, name, name + "_bucket", le="0.01", **BASE) == 2
    assert _value(fams, name, name + "_bucket", le="0.025", **BASE) == 3
    assert _value(fams, name, name + "_bucket", le="2.5", **BASE) == 3
    assert _value(fams, name, name + "_bucket", le="5.0", **BASE) == 4
    assert _value(fams, name, name + "_bucket", le="+Inf", **BASE) == 4

    name = "vllm:e2e_request_latency_seconds"
    assert _value(fams, name, name + "_count", **BASE) == 1
    assert _value(fams, name, name + "_sum", **BASE) == pytest.approx(1.2)
    assert _value(fams, name, name + "_bucket", le="1.0", **BASE) == 0
    assert _value(fams, name, name + "_bucket", le="1.5", **BASE) == 1

    name = "vllm:request_queue_time_seconds"
    assert _value(fams, name, name + "_count", **BASE) == 0
    assert _value(fams, name, name + "_sum", **BASE) == 0


def test_request_and_token_counters(metrics):
    metrics.request_done("ok", 10, 5, finished_reason="length")
    metrics.request_done("ok", 3, 2, finished_reason="stop")
    metrics.request_done("ok", 4, 1, finished_reason="stop")
    metrics.request_done("cancelled", 6, 1)
    metrics.request_done("error", 2, 0)
    fams = _parse(metrics.render([]))
    assert fams["pdserve:requests"].type == "counter"
    assert _value(fams, "pdserve:requests", "pdserve:requests_total", status="ok", **BASE) == 3
    assert _value(fams, "pdserve:requests", "pdserve:requests_total", status="cancelled", **BASE) == 1
    assert _value(fams, "pdserve:requests", "pdserve:requests_total", status="error", **BASE) == 1
    assert _value(fams, "vllm:prompt_tokens", "vllm:prompt_tokens_total", **BASE) == 25
    assert _value(fams, "vllm:generation_tokens", "vllm:generation_tokens_total", **BASE) == 9
    # Only requests the engine finished count as vLLM's successes, by finish reason.
    success = "vllm:request_success"
    assert fams[success].type == "counter"
    assert _value(fams, success, success + "_total", finished_reason="length", **BASE) == 1
    assert _value(fams, success, success + "_total", finished_reason="stop", **BASE) == 2
    assert {s.labels["finished_reason"] for s in fams[success].samples if s.name.endswith("_total")} == {
        "length", "stop"}


def test_token_count_histograms_of_finished_requests(metrics):
    metrics.request_done("ok", 10, 5, finished_reason="length")
    metrics.request_done("ok", 300, 2, finished_reason="stop")
    metrics.request_done("cancelled", 6, 1)
    fams = _parse(metrics.render([]))
    name = "vllm:request_prompt_tokens"
    assert fams[name].type == "histogram"
    assert _value(fams, name, name + "_count", **BASE) == 2
    assert _value(fams, name, name + "_sum", **BASE) == 310
    assert _value(fams, name, name + "_bucket", le="10.0", **BASE) == 1
    assert _value(fams, name, name + "_bucket", le="500.0", **BASE) == 2
    name = "vllm:request_generation_tokens"
    assert _value(fams, name, name + "_count", **BASE) == 2
    assert _value(fams, name, name + "_bucket", le="2.0", **BASE) == 1
    assert _value(fams, name, name + "_bucket", le="5.0", **BASE) == 2


def test_token_count_buckets_stop_at_the_context_length():
    m = AppMetrics("tiny", "pd", max_model_len=128)
    m.request_done("ok", 100, 100, finished_reason="length")
    fams = _parse(m.render([]))
    name = "vllm:request_prompt_tokens"
    bounds = [s.labels["le"] for s in fams[name].samples if s.name == name + "_bucket"]
    assert bounds == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"]


def test_registries_are_per_instance():
    a, b = AppMetrics("tiny", "pd"), AppMetrics("tiny", "pd")
    a.ttft.observe(0.1)
    fams = _parse(b.render([]))
    name = "vllm:time_to_first_token_seconds"
    assert _value(fams, name, name + "_count", **BASE) == 0


GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "pdserve:kv_cache_free_blocks": "free_blocks",
    "pdserve:kv_cache_total_blocks": "total_blocks",
    "pdserve:prefix_cache_hit_rate": "prefix_cache_hit_rate",
}

ENGINE_COUNTERS = {
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
    "vllm:num_preemptions": "num_preemptions",
}

TRANSFER = {
    "pdserve:kv_transfer_exports": "exports",
    "pdserve:kv_transfer_loads": "loads",
    "pdserve:kv_transfer_load_failures": "load_failures",
    "pdserve:kv_transfer_bytes_out": "bytes_out",
    "pdserve:kv_transfer_bytes_in": "bytes_in",
    "pdserve:kv_transfer_load_seconds": "load_seconds",
}


def test_replica_gauges_labelled_by_role_and_replica(metrics):
    fams = _parse(metrics.render(REPORTS))
    for name, key in GAUGES.items():
        assert fams[name].type == "gauge", name
        assert _replica_labels(fams, name) == {("prefill", "p-1"), ("decode", "d-1")}
        for r in REPORTS:
            assert _value(fams, name, name, role=str(r.role), replica=r.replica) == pytest.approx(_figure(r, key))


def test_replica_figures_carry_the_model_name(metrics):
    fams = _parse(metrics.render(REPORTS))
    for name in list(GAUGES) + list(ENGINE_COUNTERS) + list(TRANSFER):
        assert {s.labels["model_name"] for s in fams[name].samples} == {"tiny"}, name


def test_engine_counters_from_cumulative_replica_figures(metrics):
    fams = _parse(metrics.render(REPORTS))
    for name, key in ENGINE_COUNTERS.items():
        assert fams[name].type == "counter", name
        for r in REPORTS:
            assert _value(fams, name, name + "_total", role=str(r.role), replica=r.replica) == _figure(r, key)


def test_replicas_per_role_and_scaling_signals(metrics):
    fams = _parse(metrics.render(REPORTS + [dataclasses.replace(REPORTS[1], replica="d-2")]))
    assert fams["pdserve:replicas"].type == "gauge"
    assert _value(fams, "pdserve:replicas", "pdserve:replicas", role="prefill", model_name="tiny") == 1
    assert _value(fams, "pdserve:replicas", "pdserve:replicas", role="decode", model_name="tiny") == 2
    # A replica without samples yet has no percentile: no sample rather than a false 0.
    assert _replica_labels(fams, "pdserve:replica_ttft_p90_seconds") == {("prefill", "p-1")}
    assert _value(fams, "pdserve:replica_ttft_p90_seconds", "pdserve:replica_ttft_p90_seconds",
                  replica="p-1") == pytest.approx(0.3)
    assert _replica_labels(fams, "pdserve:replica_itl_p90_seconds") == {("decode", "d-1"), ("decode", "d-2")}


def test_kv_transfer_counters(metrics):
    fams = _parse(metrics.render(REPORTS))
    for name, key in TRANSFER.items():
        assert fams[name].type == "counter", name
        assert _replica_labels(fams, name) == {("prefill", "p-1"), ("decode", "d-1")}
        for r in REPORTS:
            value = _value(fams, name, name + "_total", role=str(r.role), replica=r.replica)
            assert value == pytest.approx(r.kv_transfer[key])


def test_missing_figures_read_as_zero(metrics):
    sparse = [_report("colocated", "c-1", running=2)]
    fams = _parse(metrics.render(sparse))
    assert _value(fams, "vllm:num_requests_running", "vllm:num_requests_running",
                  role="colocated", replica="c-1") == 2
    assert _value(fams, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc",
                  role="colocated", replica="c-1") == 0
    assert _value(fams, "pdserve:kv_transfer_loads", "pdserve:kv_transfer_loads_total",
                  role="colocated", replica="c-1") == 0


def test_replica_missing_from_a_later_render_is_gone(metrics):
    fams = _parse(metrics.render(REPORTS))
    assert ("decode", "d-1") in _replica_labels(fams, "vllm:num_requests_running")
    updated = [dataclasses.replace(REPORTS[0], engine=dataclasses.replace(REPORTS[0].engine, running=9))]
    fams = _parse(metrics.render(updated))
    for name in list(GAUGES) + list(ENGINE_COUNTERS) + list(TRANSFER):
        assert _replica_labels(fams, name) == {("prefill", "p-1")}, name
    assert _value(fams, "vllm:num_requests_running", "vllm:num_requests_running",
                  role="prefill", replica="p-1") == 9
    fams = _parse(metrics.render([]))
    for name in list(GAUGES) + list(ENGINE_COUNTERS) + list(TRANSFER) + ["pdserve:replicas"]:
        assert name not in fams or not fams[name].samples, name
