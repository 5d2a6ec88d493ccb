"""engine.child_signals: a process the engine spawns takes its parent process's signal mask,
not that of the thread that happened to spawn it (Serve builds a replica's engine on a thread
that blocks nothing, in a process that blocks SIGTERM; tests/cluster/test_serve_stop.py checks
the served engine core end to end). Each case runs in a fresh interpreter, so the test
process's own mask is left alone."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, multiprocessing as mp, signal, sys, threading
    from engine.child_signals import apply_blocked_signals, process_blocked_signals

    def child_mask(blocked, conn):
        apply_blocked_signals(blocked)
        conn.send(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))

    def spawn(apply, out):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM, signal.SIGINT])  # as Serve's thread
        blocked = process_blocked_signals()
        parent, child = mp.get_context("spawn").Pipe()
        p = mp.get_context("spawn").Process(target=child_mask, args=(blocked if apply else None, child))
        p.start()
        out.extend([sorted(int(s) for s in blocked), parent.recv()])
        p.join(30)

    if __name__ == "__main__":
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM, signal.SIGINT])  # as a Ray worker
        out = []
        t = threading.Thread(target=spawn, args=(sys.argv[1] == "apply", out))
        t.start(); t.join(60)
        print(json.dumps(out))
""")


def _run(tmp_path, mode: str) -> tuple[list[int], list[int]]:
    script = tmp_path / "spawn_from_thread.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=120,
                          cwd=str(tmp_path), env={"PYTHONPATH": ":".join(sys.path)})
    assert done.returncode == 0, done.stderr
    blocked, child = json.loads(done.stdout.strip().splitlines()[-1])
    return blocked, child


@pytest.mark.parametrize("mode", ["apply", "inherit"])
def test_a_child_spawned_from_an_unblocking_thread_blocks_what_its_process_blocks(tmp_path, mode):
    blocked, child = _run(tmp_path, mode)
    assert {signal.SIGTERM, signal.SIGINT} <= set(blocked)  # the process's (main thread's) mask
    if mode == "apply":
        assert {signal.SIGTERM, signal.SIGINT} <= set(child)
    else:  # what it would be without: the spawning thread's mask (the reason for the module)
        assert signal.SIGTERM not in child
