"""cluster.control.coordinator: the Board of replica reports (with explicit clock values) and its
per-role signals for the autoscaler."""

from __future__ import annotations

from cluster.control.autoscale import RoleSignal
from cluster.control.coordinator import STALE_AFTER_S, Board
from cluster.report import ReplicaReport
from cluster.roles import Role
from engine.load import EngineLoad


def _fig(replica: str, role: str = "prefill", waiting: int = 0, running: int = 0, kv_usage: float = 0.0,
         **extra) -> ReplicaReport:
    """A report whose engine has 100 KV blocks, `kv_usage` of them in use."""
    engine = EngineLoad(waiting=waiting, running=running, free_blocks=round(100 * (1 - kv_usage)), total_blocks=100)
    return ReplicaReport(replica, Role.of(role), engine, **extra)


def test_empty_board():
    board = Board()
    assert board.live(now=0.0) == []
    assert board.signals({"prefill": 1}, now=0.0) == {"prefill": RoleSignal(replicas=1)}


def test_default_stale_after():
    assert Board().stale_after_s == STALE_AFTER_S


def test_report_then_live_returns_the_figures():
    board = Board(stale_after_s=5.0)
    fig = _fig("r1", waiting=2, running=3, kv_usage=0.25)
    board.report(fig, now=100.0)
    assert board.live(now=101.0) == [fig]


def test_latest_report_replaces_the_previous_one():
    board = Board(stale_after_s=5.0)
    board.report(_fig("r1", running=1), now=100.0)
    board.report(_fig("r1", running=7), now=101.0)
    live = board.live(now=102.0)
    assert len(live) == 1
    assert live[0].engine.running == 7


def test_live_sorted_by_replica_id():
    board = Board(stale_after_s=5.0)
    for name in ["c", "a", "d", "b"]:
        board.report(_fig(name), now=10.0)
    assert [f.replica for f in board.live(now=10.0)] == ["a", "b", "c", "d"]


def test_stale_replicas_are_dropped():
    board = Board(stale_after_s=2.0)
    board.report(_fig("old"), now=1.0)
    board.report(_fig("new"), now=4.0)
    assert [f.replica for f in board.live(now=4.5)] == ["new"]          # old: 3.5 s > 2 s
    assert [f.replica for f in board.live(now=6.0)] == ["new"]          # new: 2 s, not older
    assert board.live(now=6.5) == []                                      # new: 2.5 s


def test_fresh_report_keeps_a_replica_alive():
    board = Board(stale_after_s=2.0)
    board.report(_fig("r"), now=0.0)
    board.report(_fig("r"), now=1.5)
    assert [f.replica for f in board.live(now=3.0)] == ["r"]   # 1.5 s since the last report
    assert board.live(now=4.0) == []


def test_dropped_replica_is_forgotten():
    board = Board(stale_after_s=2.0)
    board.report(_fig("r"), now=0.0)
    assert board.live(now=5.0) == []
    # an earlier clock value does not bring it back: it was deleted
    assert board.live(now=1.0) == []
    # a new report does
    board.report(_fig("r"), now=6.0)
    assert [f.replica for f in board.live(now=6.0)] == ["r"]


def test_signals_per_role():
    board = Board(stale_after_s=5.0)
    board.report(_fig("p1", "prefill", waiting=2, running=1, kv_usage=0.10), now=0.0)
    board.report(_fig("p2", "prefill", waiting=3, running=4, kv_usage=0.60), now=0.0)
    board.report(_fig("p3", "prefill", waiting=0, running=2, kv_usage=0.30), now=0.0)
    board.report(_fig("d1", "decode", waiting=1, running=8, kv_usage=0.75), now=0.0)
    assert board.signals({"prefill": 3, "decode": 1}, now=1.0) == {
        "prefill": RoleSignal(replicas=3, waiting=5, running=7, kv_usage=0.60),
        "decode": RoleSignal(replicas=1, waiting=1, running=8, kv_usage=0.75),
    }


def test_signals_leave_out_stale_replicas():
    board = Board(stale_after_s=2.0)
    board.report(_fig("p1", "prefill", waiting=2, running=1, kv_usage=0.9), now=0.0)
    board.report(_fig("p2", "prefill", waiting=3, running=4, kv_usage=0.2), now=3.0)
    board.report(_fig("d1", "decode", waiting=5, running=5, kv_usage=0.5), now=0.0)
    assert board.signals({"prefill": 1, "decode": 1}, now=4.0) == {
        "prefill": RoleSignal(replicas=1, waiting=3, running=4, kv_usage=0.2),
        "decode": RoleSignal(replicas=1),  # its only report went stale
    }


def test_boards_do_not_share_reports():
    a, b = Board(), Board()
    a.report(_fig("r"), now=0.0)
    assert b.live(now=0.0) == []
