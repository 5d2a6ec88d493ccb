"""cluster/launch/shutdown.py without Ray: a stand-in server process (a subreaper with a process tree
shaped like Ray's: a daemon in its group, a worker in a session of its own orphaned by its
parent) is stopped, and every bound and kill is checked from outside."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

from cluster.launch.shutdown import BoundedShutdown, http_connections
from engine.errors import ParameterError
from tests.cluster.helpers import free_port, proc_stat, running, wait_for

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# argv: timeout_s, drain ("hang" | "return"). Prints "ready <daemon pid> <worker pid>", then
# "draining" once stopping; the daemon stands for Ray's node daemons (direct children, same
# process group), the worker for a Ray worker (own session, its parent gone).
SERVER = r"""
import signal, subprocess, sys, threading
# As a server started from a terminal or by systemd: SIGHUP at its default. A test runner
# started under nohup passes SIGHUP ignored to its children, and install() keeps an ignored
# SIGHUP ignored (by design), so the stand-in resets it first.
signal.signal(signal.SIGHUP, signal.SIG_DFL)
from cluster.launch.shutdown import BoundedShutdown, StopServing, become_subreaper
timeout_s, drain_mode, port = float(sys.argv[1]), sys.argv[2], int(sys.argv[3])
assert become_subreaper()
stopper = BoundedShutdown(timeout_s, owns_processes=True, http_port=port)
def drain():
    print("draining", flush=True)
    if drain_mode == "hang":
        threading.Event().wait()
quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # EOF on our pipes once we exit
try:
    stopper.install()
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    daemon = subprocess.Popen(sleeper, **quiet)
    spawner = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen("
                                "sys.argv[1:], start_new_session=True, stdout=subprocess.DEVNULL).pid)", *sleeper],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    worker = int(spawner.stdout.readline())
    spawner.wait()
    stopper.watch_ray_node()
    print("ready", daemon.pid, worker, flush=True)
    stopper.wait()
except StopServing:
    pass
stopper.stop(drain, lambda: None, lambda msg: print(msg, file=sys.stderr, flush=True))
"""


class StandIn:
    def __init__(self, timeout_s: float, drain: str, port: int | None = None):
        env = {**os.environ, "PYTHONPATH": REPO}
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, str(timeout_s), drain, str(port or free_port())],
                                     cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        words = self.proc.stdout.readline().split()
        assert words[0] == "ready", words
        self.daemon, self.worker = int(words[1]), int(words[2])

    def wait_draining(self, timeout_s: float = 30.0) -> None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)  # bounded: never hang the suite
        assert ready, f"the stand-in did not start draining within {timeout_s} s"
        assert self.proc.stdout.readline().strip() == "draining"

    def wait_log(self, needle: str) -> str:
        """The stand-in's next stderr line containing `needle` (bounded by the test's wait)."""
        for line in self.proc.stderr:
            if needle in line:
                return line
        raise AssertionError(f"the stand-in exited without logging {needle!r}")

    def exit_within(self, bound_s: float) -> tuple[int, float]:
        t0 = time.monotonic()
        code = self.proc.wait(timeout=bound_s + 5)
        return code, time.monotonic() - t0

    def cleanup(self) -> None:
        for pid in (self.proc.pid, self.daemon, self.worker):
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture
def stand_in():
    made = []

    def make(*args, **kwargs) -> StandIn:
        made.append(StandIn(*args, **kwargs))
        return made[-1]

    yield make
    for s in made:
        s.cleanup()


def test_the_orphaned_worker_is_adopted_so_it_stays_a_descendant(stand_in):
    s = stand_in(30, "return")
    parent, pgid, sid = (int(x) for x in proc_stat(s.worker)[1:4])
    assert parent == s.proc.pid and pgid == sid == s.worker


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_drain_that_finishes_exits_0_with_every_descendant_killed(stand_in, sig):
    s = stand_in(30, "return")
    s.proc.send_signal(sig)
    s.wait_draining()
    code, took = s.exit_within(30)
    assert code == 0 and took < 30
    assert not running(s.daemon) and not running(s.worker)


def test_a_drain_that_hangs_is_cut_at_the_deadline_and_exits_1(stand_in):
    timeout_s = 4.0
    window_s = timeout_s - BoundedShutdown(timeout_s, owns_processes=True, http_port=8000).kill_reserve_s  # 3 s
    s = stand_in(timeout_s, "hang")
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGINT)
    s.wait_draining()
    # The drain never returns, so the stand-in exits only if the deadline cuts it. The exit
    # may come later than timeout_s on a loaded machine (the stand-in is a process among
    # others), hence the 10 s margin; the order of its log says which path it took.
    code = s.proc.wait(timeout=timeout_s + 10)
    took = time.monotonic() - t0
    log = s.proc.stderr.read()
    assert code == 1, log
    # Its deadline runs from the signal's arrival, after t0: a cut at the deadline is never early.
    assert took >= window_s, "cut before the drain window was over"
    cut = log.index(f"drain window over ({window_s:g} s); killing what is left")
    assert cut < log.index("killing 2 processes left") < log.index("stopped after"), log
    assert not running(s.daemon) and not running(s.worker)


def test_a_second_signal_skips_the_rest_of_the_drain(stand_in):
    s = stand_in(60, "hang")
    s.proc.send_signal(signal.SIGINT)
    s.wait_draining()
    s.proc.send_signal(signal.SIGINT)
    code, took = s.exit_within(10)
    assert code == 1 and took < 10
    assert not running(s.daemon) and not running(s.worker)


def test_signal_to_the_group_ends_the_drain_once_no_http_client_is_connected(stand_in):
    # The daemon dies of the group's SIGTERM, as Ray's did before pdserve blocked SIGTERM in
    # its node: Ray can no longer drain the app, so with no connection on the HTTP port there
    # is nothing to wait for.
    s = stand_in(60, "hang")
    os.killpg(s.proc.pid, signal.SIGTERM)
    code, took = s.exit_within(10)
    assert code == 0 and took < 10
    assert not running(s.worker)


def test_signal_to_the_group_waits_for_open_http_connections(stand_in):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        s = stand_in(60, "hang", port=port)
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        os.killpg(s.proc.pid, signal.SIGTERM)
        assert "waiting for 1 open HTTP connections" in s.wait_log("Ray's node went down")
        assert s.proc.poll() is None
        client.close()
        conn.close()
        code, took = s.exit_within(10)  # ... and closing it ends it
        assert code == 0 and took < 10
        assert not running(s.worker)


def test_processes_outside_the_tree_are_left_alone(stand_in):
    outsider = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        s = stand_in(30, "return")
        s.proc.send_signal(signal.SIGTERM)
        s.wait_draining()
        assert s.exit_within(30)[0] == 0
        assert outsider.poll() is None
    finally:
        outsider.kill()
        outsider.wait()


def test_http_connections_counts_established_clients_of_the_port():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert http_connections(port) == 0
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        assert http_connections(port) == 1
        client.close()
        conn.close()
        wait_for(lambda: http_connections(port) == 0, "the connection to close", 10)


@pytest.mark.parametrize("timeout_s", [0, -1])
def test_shutdown_timeout_must_be_positive(timeout_s):
    with pytest.raises(ParameterError) as e:
        BoundedShutdown(timeout_s, owns_processes=True, http_port=8000)
    assert e.value.field == "shutdown_timeout_s"
