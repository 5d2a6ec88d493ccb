"""Every metric the engine reports, defined once: name, kind, help text and buckets.

The offline recorder (engine.metrics.stats) and the Prometheus exporter (cluster.http.metrics)
both build their metrics from these definitions, so `LLM.get_metrics()` and `GET /metrics`
cannot drift apart. Metrics vLLM also has keep vLLM's name (and bucket boundaries, so
dashboards built for vLLM read ours); figures only pdserve has are prefixed `pdserve:`.
Counter names carry no `_total`: exporters add it, as Prometheus clients do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MetricKind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: MetricKind
    doc: str
    buckets: tuple[float, ...] = ()  # histograms only: upper bounds, ascending, +Inf implied

    def __post_init__(self) -> None:
        if (self.kind == "histogram") != bool(self.buckets):
            raise ValueError(f"{self.name}: buckets are required for a histogram and only for one")
        if list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"{self.name}: buckets must be strictly ascending")


def token_count_buckets(max_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_len`: vLLM's bounds for token-count histograms."""
    out: list[float] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_len:
                return tuple(out)
            out.append(float(step * scale))
        scale *= 10


TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# ---- per request, seen where the request is seen whole (ingress online, LLMEngine offline) ----
TIME_TO_FIRST_TOKEN = MetricDef("vllm:time_to_first_token_seconds", "histogram",
                                "Time to first token, arrival to first token out", TTFT_BUCKETS)
INTER_TOKEN_LATENCY = MetricDef("vllm:inter_token_latency_seconds", "histogram",
                                "Time between consecutive token outputs of a request", ITL_BUCKETS)
E2E_REQUEST_LATENCY = MetricDef("vllm:e2e_request_latency_seconds", "histogram",
                                "Request latency, arrival to last token", REQUEST_LATENCY_BUCKETS)
REQUEST_QUEUE_TIME = MetricDef("vllm:request_queue_time_seconds", "histogram",
                               "Time waiting in the engine queue before first scheduled", REQUEST_LATENCY_BUCKETS)
PROMPT_TOKENS = MetricDef("vllm:prompt_tokens", "counter", "Prompt tokens processed")
GENERATION_TOKENS = MetricDef("vllm:generation_tokens", "counter", "Tokens generated")
REQUEST_SUCCESS = MetricDef("vllm:request_success", "counter",
                            "Requests finished, by finish reason (label finished_reason)")


def request_prompt_tokens(max_len: int) -> MetricDef:
    return MetricDef("vllm:request_prompt_tokens", "histogram", "Prompt tokens of finished requests",
                     token_count_buckets(max_len))


def request_generation_tokens(max_len: int) -> MetricDef:
    return MetricDef("vllm:request_generation_tokens", "histogram", "Generated tokens of finished requests",
                     token_count_buckets(max_len))


# ---- per engine, read from EngineLoad.figures() (key -> metric) ----------------------------------
ENGINE_FIGURES: dict[str, MetricDef] = {
    "running": MetricDef("vllm:num_requests_running", "gauge", "Requests in the engine's running set"),
    "waiting": MetricDef("vllm:num_requests_waiting", "gauge", "Requests waiting in the engine's queue"),
    "kv_usage": MetricDef("vllm:kv_cache_usage_perc", "gauge", "KV cache usage, 1 meaning every block in use"),
    "prefix_cache_queries": MetricDef("vllm:prefix_cache_queries", "counter",
                                      "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": MetricDef("vllm:prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache"),
    "external_prefix_cache_queries": MetricDef("vllm:external_prefix_cache_queries", "counter",
                                               "Prompt tokens looked up by the KV connector (P/D, host tier)"),
    "external_prefix_cache_hits": MetricDef("vllm:external_prefix_cache_hits", "counter",
                                            "Prompt tokens the KV connector loaded instead of computing them"),
    "num_preemptions": MetricDef("vllm:num_preemptions", "counter", "Requests preempted by the scheduler"),
    "num_steps": MetricDef("pdserve:engine_steps", "counter", "Engine steps that ran a forward pass"),
    "num_scheduled_tokens": MetricDef("pdserve:engine_step_tokens", "counter",
                                      "Tokens those steps ran, prompt and generated (divided by "
                                      "pdserve:engine_steps: tokens per step)"),
    "free_blocks": MetricDef("pdserve:kv_cache_free_blocks", "gauge", "Free KV cache blocks"),
    "total_blocks": MetricDef("pdserve:kv_cache_total_blocks", "gauge", "KV cache blocks in all"),
    "encoder_cache_queries": MetricDef("pdserve:encoder_cache_queries", "counter",
                                       "Images looked up in the encoder cache"),
    "encoder_cache_hits": MetricDef("pdserve:encoder_cache_hits", "counter",
                                    "Images found in the encoder cache (not encoded again)"),
    "encoder_seconds": MetricDef("pdserve:encoder_seconds", "counter", "Seconds spent in the vision encoder"),
    "prefix_cache_hit_rate": MetricDef("pdserve:prefix_cache_hit_rate", "gauge",
                                       "Prefix cache hit rate (tokens), since the engine started"),
}

# ---- speculative decoding, in EngineLoad.figures() when the engine speculates -------------------
SPEC_DECODE_FIGURES: dict[str, MetricDef] = {
    "spec_decode_num_drafts": MetricDef("vllm:spec_decode_num_drafts", "counter",
                                        "Verification steps of a request with at least one draft token"),
    "spec_decode_num_draft_tokens": MetricDef("vllm:spec_decode_num_draft_tokens", "counter",
                                              "Draft tokens proposed and verified"),
    "spec_decode_num_accepted_tokens": MetricDef("vllm:spec_decode_num_accepted_tokens", "counter",
                                                 "Draft tokens the target model accepted"),
}
# A list in EngineLoad.figures(): one counter per draft position, labelled position="0", "1", ...
SPEC_DECODE_PER_POS_KEY = "spec_decode_num_accepted_tokens_per_pos"
SPEC_DECODE_PER_POS = MetricDef("vllm:spec_decode_num_accepted_tokens_per_pos", "counter",
                                "Draft tokens accepted, by position in the draft (label position)")

# ---- data parallelism: figures per core, in EngineLoad.figures()["data_parallel"] (a list whose
# entry i is core i's), labelled engine="i" as vLLM labels its data-parallel engines -------------
DP_KEY = "data_parallel"
DP_FIGURES: dict[str, MetricDef] = {
    "running": MetricDef("pdserve:dp_engine_requests_running", "gauge",
                         "Requests running on each data-parallel engine core (label engine)"),
    "waiting": MetricDef("pdserve:dp_engine_requests_waiting", "gauge",
                         "Requests waiting on each data-parallel engine core (label engine)"),
    "requests": MetricDef("pdserve:dp_engine_requests", "counter",
                          "Requests the front end routed to each data-parallel engine core (label engine)"),
    "dummy_steps": MetricDef("pdserve:dp_dummy_batches", "counter",
                             "Forward passes on no tokens an idle core ran so the busy cores' expert-parallel "
                             "collectives could proceed (label engine)"),
    "wave": MetricDef("pdserve:dp_wave", "gauge",
                      "Request wave each data-parallel engine core is in; it advances when all are idle"),
}

# ---- P/D: a decode replica's KV connector, from its KV-transfer counters (keys
# kvstore.kv_io.refusal_key(reason)), labelled reason="..." (kvstore.kv_io.REFUSAL_REASONS) -----
KV_TRANSFER_REFUSED = MetricDef("pdserve:kv_transfer_refused", "counter",
                                "KV transfers refused as malformed before any write into the cache, by "
                                "reason (label reason); each is also a KV load failure")

# ---- LoRA: in EngineLoad.figures()["lora"] when enable_lora is on. As vLLM's, one gauge whose
# labels are the adapter names (comma-joined) and whose value is the report's wall time -------
LORA_KEY = "lora"
LORA_REQUESTS_INFO = MetricDef("vllm:lora_requests_info", "gauge",
                               "Running and waiting LoRA adapters (labels running_lora_adapters, "
                               "waiting_lora_adapters, max_lora); the value is when it was reported")


def lora_info_labels(figures: dict) -> dict[str, str]:
    """vllm:lora_requests_info's labels from EngineLoad.figures()["lora"]."""
    return {"running_lora_adapters": ",".join(figures["running"]),
            "waiting_lora_adapters": ",".join(figures["waiting"]), "max_lora": str(figures["max_lora"])}
