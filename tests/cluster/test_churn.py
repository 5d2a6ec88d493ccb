"""scripts/churn.py, briefly: two SIGKILLs of engine processes (a replica or an engine core,
picked at random among those Serve's `processes()` names) under two client threads against a
P/D app with direct streaming and engine cores in processes of their own. The outcomes the
issue requires: no wrong 200 (the oracle: transformers' greedy text of every prompt), every
failure a 5xx with Retry-After or a retry that succeeded, no leaked block, hand-off or transfer
once every role is back, each long-lived process's RSS within the stated bound, and every
prompt answered with transformers' text afterwards. docs/operations.md#churn has the figures
of a 10-minute run."""

from __future__ import annotations

import pytest

from tests.cluster.helpers import DIRECT_APP as APP
from tests.cluster.helpers import DIRECT_NAME as NAME
from tests.cluster.helpers import hf_text


@pytest.fixture(scope="module")
def app(shared_direct_app):
    return shared_direct_app.url()


def test_two_kills_under_load_leave_no_wrong_answer_no_unexplained_failure_no_leak_and_bounded_rss(
        app, tiny_model):
    from scripts.churn import PROMPTS, run_churn

    expected = [hf_text(tiny_model, p, 8) for p in PROMPTS]
    lines: list[str] = []
    report = run_churn(app, APP, NAME, duration_s=8.0, every_s=4.0, clients=2, max_tokens=8, warm_s=2.0,
                       seed=3, timeout_s=60.0, retry_s=120.0, log=lines.append, oracle=expected)
    assert len(report["kills"]) == 2, (report["kills"], lines)
    assert report["wrong_200"] == 0, report["wrong_examples"]
    assert report["unacceptable_failures"] == {}, (report["attempt_failures"], report["failure_examples"])
    assert report["leak"] is None
    assert report["rss"] and all(r["ok"] for r in report["rss"]), report["rss"]
    assert report["requests"] == report["first_try"] + report["retried_ok"] + report["failed"] > 0
    assert report["ok"]
    from cluster.pd.placement import FALLBACK_REASONS

    assert set(report["pd_fallbacks"]) == set(FALLBACK_REASONS)  # counted by reason, each shown
    from cluster.http.migration import MIGRATION_REASONS

    assert set(report["migrations"]) == set(MIGRATION_REASONS)
    # And the server it recovered to answers every prompt with transformers' text.
    from tests.cluster.helpers import openai_client

    client = openai_client(app)
    got = [client.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0).choices[0].text
           for p in PROMPTS]
    assert got == expected


def test_rss_counts_only_processes_that_lived_through_as_the_same_job_and_holds_them_to_the_bound():
    from scripts.churn import RSS_GROWTH, RSS_SLACK_MIB, rss_report

    warm = {1: (100, "ray::ServeController", 200.0), 2: (100, "ray::IDLE", 50.0), 3: (100, "ray::KVStore", 100.0),
            4: (100, "ray::ServeReplica:churn:Coordinator", 300.0)}
    end = {1: (100, "ray::ServeController", 200.0 * RSS_GROWTH + RSS_SLACK_MIB),  # at the bound
           2: (100, "ray::ServeReplica:churn:Prefill", 900.0),  # an idle worker that became a replica
           3: (999, "ray::KVStore", 900.0),  # a new process under a reused pid
           4: (100, "ray::ServeReplica:churn:Coordinator", 300.0 * RSS_GROWTH + RSS_SLACK_MIB + 1)}
    rows = {r["pid"]: r["ok"] for r in rss_report(warm, end)}
    assert rows == {1: True, 4: False}
