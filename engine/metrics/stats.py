"""Offline request statistics: what the ingress measures online, measured in LLMEngine.

The recorder sees each request when it is added and each RequestOutput a step produces,
and keeps vLLM's per-request figures (TTFT, inter-token latency, E2E, queue time, token
counts, finish reasons) as cumulative counters and histograms. Engine-wide figures (running,
waiting, KV usage, prefix-cache and preemption counters) are not kept here: they are read
from EngineLoad.figures() when a snapshot is taken, as the replicas report them online.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter as Tally
from dataclasses import dataclass

import engine.metrics.names as names
from engine.metrics.reader import Counter, Gauge, Histogram, Metric, bound_label
from engine.outputs import RequestOutput


class _Histogram:
    def __init__(self, definition: names.MetricDef) -> None:
        self.definition = definition
        self.counts = [0] * (len(definition.buckets) + 1)  # last: above every bound
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.definition.buckets, value)] += 1
        self.total += value

    def snapshot(self, labels: dict[str, str]) -> Histogram:
        buckets, running = {}, 0
        for bound, n in zip((*self.definition.buckets, float("inf")), self.counts):
            running += n
            buckets[bound_label(bound)] = running
        return Histogram(self.definition.name, dict(labels), buckets, running, self.total)


@dataclass
class _Live:
    """A request between add_request and its last output (monotonic seconds)."""

    arrival: float
    last_token: float | None = None


class StatsRecorder:
    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.labels = {"model_name": model_name}
        self._live: dict[str, _Live] = {}
        self.ttft = _Histogram(names.TIME_TO_FIRST_TOKEN)
        self.itl = _Histogram(names.INTER_TOKEN_LATENCY)
        self.e2e = _Histogram(names.E2E_REQUEST_LATENCY)
        self.queue = _Histogram(names.REQUEST_QUEUE_TIME)
        self.request_prompt_tokens = _Histogram(names.request_prompt_tokens(max_model_len))
        self.request_generation_tokens = _Histogram(names.request_generation_tokens(max_model_len))
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Tally[str] = Tally()  # finish reason -> requests

    def request_added(self, request_id: str, arrival_time: float) -> None:
        """`arrival_time` on time.monotonic()'s clock (Request.arrival_time)."""
        self._live[request_id] = _Live(arrival_time)

    def request_aborted(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def record(self, outputs: list[RequestOutput], now: float | None = None) -> None:
        """Account one step's outputs."""
        now = time.monotonic() if now is None else now
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            if "queue_time_s" in out.metrics:
                self.queue.observe(out.metrics["queue_time_s"])
            if out.delta_token_ids:
                if live.last_token is None:
                    # The prompt counts once it has been processed: at its first token.
                    self.ttft.observe(now - live.arrival)
                    self.prompt_tokens += len(out.prompt_token_ids)
                else:
                    self.itl.observe(now - live.last_token)
                live.last_token = now
                self.generation_tokens += len(out.delta_token_ids)
            if out.finished:
                del self._live[out.request_id]
                self.e2e.observe(now - live.arrival)
                self.finished[out.outputs[0].finish_reason] += 1
                self.request_prompt_tokens.observe(len(out.prompt_token_ids))
                self.request_generation_tokens.observe(len(out.outputs[0].token_ids))

    def snapshot(self, engine_figures: dict) -> list[Metric]:
        """Every metric now, engine-wide ones from `engine_figures` (EngineLoad.figures())."""
        labels = self.labels
        metrics: list[Metric] = []
        for key, definition in names.ENGINE_FIGURES.items():
            if key not in engine_figures:
                continue
            value = engine_figures[key]
            if definition.kind == "counter":
                # Counts are ints; a time counter keeps its fraction.
                value = value if isinstance(value, float) else int(value)
                metrics.append(Counter(definition.name, dict(labels), value))
            else:
                metrics.append(Gauge(definition.name, dict(labels), float(value)))
        for key, definition in names.SPEC_DECODE_FIGURES.items():
            if key in engine_figures:
                metrics.append(Counter(definition.name, dict(labels), int(engine_figures[key])))
        for pos, n in enumerate(engine_figures.get(names.SPEC_DECODE_PER_POS_KEY, ())):
            metrics.append(Counter(names.SPEC_DECODE_PER_POS.name, {**labels, "position": str(pos)}, int(n)))
        for core in engine_figures.get(names.DP_KEY, ()):
            for key, definition in names.DP_FIGURES.items():
                core_labels = {**labels, "engine": str(core["rank"])}
                metrics.append(Counter(definition.name, core_labels, int(core[key])) if definition.kind == "counter"
                               else Gauge(definition.name, core_labels, float(core[key])))
        if names.LORA_KEY in engine_figures:
            lora_labels = {**labels, **names.lora_info_labels(engine_figures[names.LORA_KEY])}
            metrics.append(Gauge(names.LORA_REQUESTS_INFO.name, lora_labels, time.time()))
        metrics.append(Counter(names.PROMPT_TOKENS.name, dict(labels), self.prompt_tokens))
        metrics.append(Counter(names.GENERATION_TOKENS.name, dict(labels), self.generation_tokens))
        for reason, n in sorted(self.finished.items()):
            metrics.append(Counter(names.REQUEST_SUCCESS.name, {**labels, "finished_reason": reason}, n))
        for hist in (self.ttft, self.itl, self.e2e, self.queue, self.request_prompt_tokens,
                     self.request_generation_tokens):
            metrics.append(hist.snapshot(labels))
        return metrics
