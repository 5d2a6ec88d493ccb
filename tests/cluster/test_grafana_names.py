"""vLLM's published Grafana dashboard works on pdserve's /metrics: every series its panels
query is exported under that exact name (with the model_name label the panels filter on),
except the few listed below, each with why it cannot apply."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from cluster.http.metrics import AppMetrics
from cluster.report import ReplicaReport
from cluster.roles import Role
from engine.load import EngineLoad

# The series the panel queries of vLLM's dashboard reference, names only, from
# vllm-project/vllm examples/observability/prometheus_grafana/grafana.json
# (commit 4b5c627c23e6690b8987100d1cbf78e34ac14bf9; formerly examples/online_serving/...).
DASHBOARD_SERIES = (
    "vllm:e2e_request_latency_seconds_bucket",  # E2E Request Latency
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",  # Token Throughput
    "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket",  # Inter Token Latency
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running",  # Scheduler State
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",  # Time To First Token Latency
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",  # Cache Utilization
    "vllm:request_prompt_tokens_bucket",  # Request Prompt Length
    "vllm:request_generation_tokens_bucket",  # Request Generation Length
    "vllm:request_success_total",  # Finish Reason
    "vllm:request_queue_time_seconds_sum",  # Queue Time
    "vllm:request_prefill_time_seconds_sum",  # Requests Prefill and Decode Time
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",  # Max Generation Token in Sequence Group
)

CANNOT_EXPORT = {
    "vllm:request_prefill_time_seconds_sum":
        "engine-side phase time (scheduled to first token); the ingress sees only client-side TTFT/E2E",
    "vllm:request_decode_time_seconds_sum":
        "engine-side phase time (first to last token inside the engine); not reported by replicas",
    "vllm:request_max_num_generation_tokens_sum":
        "a request's max_tokens is not passed to AppMetrics.request_done",
}

REPORT = ReplicaReport("c-1", Role.COLOCATED, EngineLoad(running=1, free_blocks=9, total_blocks=10))


def _exported_series(model_name: str) -> set[str]:
    """Sample names of a /metrics text after one of everything, labelled with model_name."""
    metrics = AppMetrics(model_name, "colocated")
    for hist in (metrics.ttft, metrics.itl, metrics.e2e, metrics.queue):
        hist.observe(0.1)
    metrics.request_done("ok", 12, 4, finished_reason="length")
    text = metrics.render([REPORT]).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples
            if s.labels.get("model_name") == model_name}


def test_every_dashboard_series_is_exported_but_the_listed_ones():
    exported = _exported_series("tiny")
    missing = [name for name in DASHBOARD_SERIES if name not in exported and name not in CANNOT_EXPORT]
    assert not missing


def test_the_exemptions_are_dashboard_series_still_not_exported():
    exported = _exported_series("tiny")
    assert set(CANNOT_EXPORT) <= set(DASHBOARD_SERIES)
    assert not set(CANNOT_EXPORT) & exported  # exported now: drop it from the exemptions
