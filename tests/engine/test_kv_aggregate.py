"""The tensor-parallel group's KV-connector report: a load counts once, when every rank is
done; a failure only after every rank has reported (no rank may still write the blocks)."""

from __future__ import annotations

from engine.executor.kv_aggregate import KVOutputAggregator
from engine.sched.output import KVConnectorOutput


def _recv(*rids: str) -> KVConnectorOutput:
    return KVConnectorOutput(finished_recving=set(rids))


def test_a_load_is_reported_once_when_the_last_rank_finishes_it():
    agg = KVOutputAggregator(2)
    assert agg.merge([_recv("a"), None]) is None  # rank 1 still loading
    assert agg.merge([None, KVConnectorOutput()]) is None
    assert agg.merge([None, _recv("a")]).finished_recving == {"a"}
    assert agg.pending == 0


def test_a_failed_rank_fails_the_load_only_once_every_rank_reported():
    agg = KVOutputAggregator(2)
    assert agg.merge([KVConnectorOutput(failed_recving={"a": "lost"}), None]) is None
    out = agg.merge([None, _recv("a")])
    assert out.failed_recving == {"a": "lost"} and not out.finished_recving


def test_exports_count_once_every_rank_sent_its_shard():
    agg = KVOutputAggregator(2)
    both = KVConnectorOutput(finished_sending={"p"})
    assert agg.merge([both, both]).finished_sending == {"p"}


def test_finished_requests_are_forgotten_with_their_partial_reports():
    agg = KVOutputAggregator(2)
    agg.merge([_recv("gone"), None])
    agg.forget({"gone"})
    assert agg.pending == 0
