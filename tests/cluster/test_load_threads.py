"""The load helpers of the HTTP tests (tests/cluster/helpers.py): a load or helper thread that
fails, or does not end, fails the test that started it."""

from __future__ import annotations

import threading

import pytest
import requests

from tests.cluster.helpers import LoadThreads, in_thread, wait_for


def test_load_threads_send_until_stopped_and_report_nothing_when_all_went_well():
    calls: list[tuple[int, int]] = []

    def send(worker: int, i: int) -> None:
        calls.append((worker, i))
        threading.Event().wait(0.001)  # a request's pace, not a synchronisation

    with LoadThreads(send, 3) as load:
        wait_for(lambda: load.check() or {w for w, _ in calls} == {0, 1, 2}, "every thread to send")
    assert not load.errors
    for worker in range(3):
        mine = [i for w, i in calls if w == worker]
        assert mine == list(range(len(mine)))  # each thread counts its own calls from 0


def test_a_failing_load_thread_fails_the_wait_at_once_and_the_block_at_its_end():
    def send(worker: int, i: int) -> None:
        if worker == 1 and i == 2:
            raise requests.ConnectionError("connection reset by peer")

    with pytest.raises(AssertionError, match=r"1 load thread\(s\) failed: load-1: ConnectionError") as failed:
        with LoadThreads(send, 2) as load:
            # Would wait 60 s for a condition that never holds: check() ends it as soon as a
            # thread fails.
            wait_for(lambda: load.check() or False, "a condition that never holds", 60)
    assert isinstance(failed.value.__cause__, requests.ConnectionError)
    # The block's own end raises it too, when the test never called check().
    with pytest.raises(AssertionError, match="connection reset") as failed:
        with LoadThreads(send, 2) as load:
            wait_for(lambda: load.errors, "the thread to fail")
    assert isinstance(failed.value.__cause__, requests.ConnectionError)


def test_a_failed_answer_check_in_a_load_thread_fails_the_test():
    def send(worker: int, i: int) -> None:
        assert i < 3, "a wrong 200"

    with pytest.raises(AssertionError, match="a wrong 200"):
        with LoadThreads(send, 1) as load:
            wait_for(lambda: load.check() or False, "a condition that never holds", 60)


def test_a_load_thread_that_outlives_its_bound_fails_the_test():
    release = threading.Event()
    try:
        with pytest.raises(AssertionError, match=r"still sending 0.2 s after the stop: \['load-0'\]"):
            with LoadThreads(lambda worker, i: release.wait(60), 1, join_timeout_s=0.2):
                pass
    finally:
        release.set()


def test_in_thread_gives_the_result_or_raises_what_the_function_raised():
    assert in_thread(lambda a, b: a + b, 2, 3).result(timeout=10) == 5

    def fails():
        raise RuntimeError("delete failed")

    with pytest.raises(RuntimeError, match="delete failed"):
        in_thread(fails).result(timeout=10)
