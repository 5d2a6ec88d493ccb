"""Bounded shutdown of `pdserve serve`: every stop path ends every process it started within
`timeout_s` of the first stop signal.

The stop paths and what they reach:
- Ctrl-C (SIGINT to the terminal's foreground group): the driver and Ray's node daemons, which
  block SIGINT, so in effect the driver only.
- SIGTERM to the driver only (docker stop, Kubernetes, systemd KillMode=mixed).
- SIGTERM to the process group (`kill -- -PGID`): `pdserve serve` starts its Ray node with
  SIGTERM and SIGHUP blocked (cluster.launch.serve_cli), and every Ray process inherits that mask, so
  again only the driver acts on it. Before that, the raylet unregistered its node at once and
  exited, taking Serve's workers and their streams with it, at its own pace.
- SIGTERM to every process of the cgroup (systemd's default KillMode=control-group): as the
  group, except for HAProxy, the HTTP proxy, which sets its own signal mask and stops at once
  on SIGTERM, ending open connections. docs/operations.md#systemd: use KillMode=mixed.

Still the driver does not trust anything it waits on. The graceful part (delete the app: Serve
stops routing to it and lets in-flight requests finish; then stop Serve) runs in a thread, and
the main thread, which keeps handling signals, waits for it until the drain deadline, or, when
Ray's node died anyway (a daemon killed outright, or a Ray started without the mask), until no
HTTP connection is open. Then it
SIGKILLs what is left of its own process tree (no SIGTERM first: each process has had its
graceful chance, and Ray workers would not act on it). This process is made a child
subreaper before Ray starts, so workers orphaned by a dead raylet are re-parented to it
rather than to init: "what pdserve started" is exactly its descendants, found by walking
/proc, and nothing outside that tree (another Ray, another test) is ever signalled. Nothing
is found or killed by name.

The driver's main thread watches the deadline, rather than a reaper child: a child would
need its own way to find orphans once the driver is gone and would itself have to survive the
group's SIGTERM; the main thread only needs the GIL, which Ray's blocking calls release. Past
the deadline the supervisor of the service (systemd's TimeoutStopSec, docker's stop timeout)
is the backstop.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

PR_SET_CHILD_SUBREAPER = 36
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_TCP_ESTABLISHED = "01"
_POLL_S = 0.25  # how often the supervisor looks at the process tree and the HTTP port while stopping
_REAP_EVERY_S = 30.0  # while serving: orphans adopted meanwhile are rare (a dead worker's subprocesses)


def become_subreaper() -> bool:
    """Orphaned descendants (Ray workers whose raylet died) are re-parented to this process
    instead of init, so they stay findable as descendants. Linux only; False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) from /proc/PID/stat; None once the pid is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
    return int(fields[1]), fields[0]


def descendants(root: int | None = None) -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, state)} of every process below `root` (default: this one), zombies
    ("Z") included."""
    root = os.getpid() if root is None else root
    if not os.path.isdir("/proc"):  # not Linux: nothing to walk, the stop keeps only its deadline
        return {}
    children: dict[int, list[int]] = {}
    stats: dict[int, tuple[int, str]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            children.setdefault(st[0], []).append(int(name))
            stats[int(name)] = st
    found: dict[int, tuple[int, str]] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = stats[child]
            todo.append(child)
    return found


def _kill_if_still_below(pid: int, tree: set[int]) -> None:
    """SIGKILL `pid` if its parent is still in `tree`. A pidfd pins the process before the
    check, so a pid that died and was reused by a stranger in between is never signalled."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:  # a kernel before 5.3: check, then kill by pid (a small race remains)
        if (_stat(pid) or (0, ""))[0] in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return
    try:
        st = _stat(pid)
        if st is not None and st[0] in tree:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
    finally:
        os.close(fd)


def reap_zombie_children(keep: set[int] = frozenset()) -> None:
    """Reap this process's dead children except `keep`: as a subreaper it adopts orphans,
    and nobody else waits for them. `keep` are children whose Popen objects (Ray's, for its
    node daemons) will wait for them and must not find them gone."""
    for pid in _children(os.getpid()) - keep:
        if (_stat(pid) or (0, ""))[1] == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def kill_descendants(deadline: float) -> int:
    """SIGKILL every live descendant of this process until none is left or `deadline`
    (time.monotonic()) passes; returns how many are still alive (0 on success)."""
    while True:
        live = [pid for pid, (_, state) in descendants().items() if state != "Z"]
        if not live or time.monotonic() >= deadline:
            reap_zombie_children()
            return len(live)
        tree = {os.getpid(), *descendants()}
        for pid in live:
            _kill_if_still_below(pid, tree)
        time.sleep(0.05)  # SIGKILLed processes need a moment to leave; bounded by `deadline`


def http_connections(port: int) -> int:
    """Established TCP connections to local `port` (clients of the HTTP proxy), IPv4 and IPv6."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == _TCP_ESTABLISHED and int(cols[1].rsplit(":", 1)[1], 16) == port:
                n += 1
    return n


class StopServing(BaseException):
    """Raised in the main thread by the first stop signal, wherever it is (starting up or
    serving), like KeyboardInterrupt; BaseException so that `except Exception` does not eat it."""


@dataclass
class BoundedShutdown:
    """Turns SIGINT/SIGTERM/SIGHUP into one bounded stop of everything this process started.

    timeout_s: from the first stop signal until every process is gone. In-flight requests may
    run until `timeout_s - kill_reserve_s`; the last part is for killing what is left.
    owns_processes: this process started its own Ray (kill its descendants at the end);
    False when attached to a cluster through RAY_ADDRESS (never kill anything).
    http_port: the port the Serve proxy listens on (its connections are the in-flight requests).
    """

    timeout_s: float
    owns_processes: bool
    http_port: int
    deadline: float | None = None
    signal_name: str = ""
    _wake: threading.Event = field(default_factory=threading.Event)
    _forced: bool = False
    _ray_node: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            from engine.errors import ParameterError  # here: importing `engine` loads torch

            raise ParameterError("shutdown_timeout_s", f"shutdown_timeout_s must be > 0, got {self.timeout_s}")

    @property
    def kill_reserve_s(self) -> float:
        # SIGKILL is immediate, but a process tearing down GPU state can take seconds to exit.
        return min(5.0, self.timeout_s / 4)

    def install(self) -> None:
        """Handle the stop signals here (main thread). Call again after ray.init, which sets
        its own SIGTERM handler. A SIGHUP ignored by the caller (nohup) stays ignored."""
        for sig in STOP_SIGNALS:
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue
            signal.signal(sig, self._on_signal)

    def watch_ray_node(self) -> None:
        """Remember the processes ray.init started here (this process's children: GCS, raylet,
        dashboard, monitors). One of them dying while the app drains means they got the stop
        signal too; Serve can then no longer stop the app and waiting for it is pointless."""
        if self.owns_processes:
            self._ray_node = {pid for pid in _children(os.getpid()) if (_stat(pid) or (0, "Z"))[1] != "Z"}

    def wait(self) -> NoReturn:
        """Serve until the first stop signal, which raises StopServing here."""
        while True:
            time.sleep(_REAP_EVERY_S)
            reap_zombie_children(keep=self._ray_node)

    def _on_signal(self, signum: int, frame) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + self.timeout_s
            self.signal_name = signal.Signals(signum).name
            raise StopServing(self.signal_name)
        self._forced = True  # a second signal: stop waiting for the drain
        self._wake.set()

    def stop(self, drain: Callable[[], None], teardown: Callable[[], None],
             log: Callable[[str], None], failed: bool = False) -> NoReturn:
        """Run `drain` (delete the app: Serve lets in-flight requests finish) and `teardown`
        (stop Serve and Ray) in a thread until the drain deadline, kill what is left of this
        process tree, and exit: 0 when no in-flight request was cut short, else 1 (also 1 when
        `failed`: stopping after an error)."""
        if self.deadline is None:  # stopping without a signal (an error while starting)
            self.deadline = time.monotonic() + self.timeout_s
        done, drained = self._wake, threading.Event()

        def run() -> None:
            try:
                drain()
                drained.set()
                log(f"app deleted after {self._elapsed():.1f} s")
                teardown()
                log(f"teardown done after {self._elapsed():.1f} s")
            except BaseException as e:  # noqa: BLE001 - a failed step ends in the kill below
                log(f"graceful shutdown failed: {e!r}")
            finally:
                done.set()

        threading.Thread(target=run, name="pdserve-graceful-shutdown", daemon=True).start()
        drain_end = self.deadline - self.kill_reserve_s
        clean, told = not failed, False
        while not done.is_set():
            remaining = drain_end - time.monotonic()
            if remaining <= 0:
                log(f"drain window over ({self.timeout_s - self.kill_reserve_s:g} s); killing what is left")
                clean = False
                break
            if not drained.is_set() and self._ray_node_lost():
                # Ray's node is going down (a daemon was killed, or it did not block SIGTERM) and
                # cannot stop the app, but Serve's proxy and replicas may still finish the
                # requests they hold, so their HTTP connections are the drain.
                open_now = http_connections(self.http_port)
                if open_now == 0:
                    log("Ray's node went down; no request in flight, killing what is left")
                    break
                if not told:
                    log(f"Ray's node went down; waiting for {open_now} open HTTP connections")
                    told = True
            done.wait(min(_POLL_S, remaining))
        clean = clean and not self._forced
        left = [pid for pid, (_, state) in descendants().items() if state != "Z"] if self.owns_processes else []
        if left:
            log(f"killing {len(left)} processes left after {self._elapsed():.1f} s")
        alive = kill_descendants(self.deadline) if left else 0
        if alive:
            log(f"{alive} processes still alive at the deadline")
        log(f"stopped after {self._elapsed():.1f} s")
        # Exit here, skipping atexit: Ray's hooks would wait on a GCS that may be gone, and the
        # graceful thread may still be stuck in a Ray call.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if clean and not alive else 1)

    def _elapsed(self) -> float:
        return time.monotonic() - (self.deadline - self.timeout_s)

    def _ray_node_lost(self) -> bool:
        return any((_stat(pid) or (0, "X"))[1] in ("Z", "X") for pid in self._ray_node)


def _children(pid: int) -> set[int]:
    """Direct children of `pid`, from the kernel's per-thread lists (cheap: no /proc scan)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
        found: set[int] = set()
        for tid in tids:
            with contextlib.suppress(FileNotFoundError):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    found.update(int(c) for c in f.read().split())
        return found
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN
        return {c for c, (parent, _) in descendants(pid).items() if parent == pid}
