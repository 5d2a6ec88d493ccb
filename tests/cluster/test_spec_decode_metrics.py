"""Speculative-decoding counters reach /metrics under vLLM's names, per replica, with the
per-position counter labelled by position; replicas that do not speculate add no series."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from actors.report import ReplicaReport
from actors.roles import Role
from cluster.http.metrics import AppMetrics
from engine.load import EngineLoad, SpecDecodeCounts

SPEC = SpecDecodeCounts(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=17,
                        num_accepted_tokens_per_pos=(9, 5, 3))
REPORTS = [
    ReplicaReport("p-1", Role.PREFILL, EngineLoad(running=1)),
    ReplicaReport("d-1", Role.DECODE, EngineLoad(running=2, spec_decode=SPEC)),
]


def _samples(text: bytes, name: str) -> list:
    return [s for f in text_string_to_metric_families(text.decode()) for s in f.samples if s.name == name]


def test_spec_decode_counters_are_exported_for_the_speculating_replica():
    text = AppMetrics("tiny", "pd").render(REPORTS)
    for key, total in (("num_drafts", 10), ("num_draft_tokens", 30), ("num_accepted_tokens", 17)):
        samples = _samples(text, f"vllm:spec_decode_{key}_total")
        assert [(s.labels["replica"], s.value) for s in samples] == [("d-1", total)]
    per_pos = _samples(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert sorted((s.labels["position"], s.value) for s in per_pos) == [("0", 9), ("1", 5), ("2", 3)]
    assert all(s.labels["role"] == "decode" and s.labels["model_name"] == "tiny" for s in per_pos)
