"""engine.child_signals: an engine core process spawned in a server replica blocks what the
replica process blocks (SIGTERM, SIGINT), though multiprocessing's spawn starts a child with
nothing blocked and Serve runs parts of a replica on threads that block nothing; the served
engine core is checked end to end in tests/cluster/test_serve_stop.py. Each case runs in a
fresh interpreter (loading only the module, not torch), so the test process's mask is left
alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import engine.child_signals

SCRIPT = textwrap.dedent("""
    import importlib.util, json, multiprocessing as mp, signal, sys, threading

    spec = importlib.util.spec_from_file_location("child_signals", sys.argv[2])
    child_signals = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(child_signals)

    def child_mask(blocked, conn):
        child_signals.apply_blocked_signals(blocked)
        conn.send(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))

    def spawn(with_mask, out):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM, signal.SIGINT])  # as Serve's thread
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        blocked = child_signals.process_blocked_signals() if with_mask else None
        p = ctx.Process(target=child_mask, args=(blocked, child))
        p.start()
        child.close()
        mine = sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))
        got = parent.recv() if parent.poll(60) else None  # bounded: a dead child says nothing
        out.extend([sorted(int(s) for s in child_signals.process_blocked_signals()), mine, got])
        p.join(30)

    if __name__ == "__main__":
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM, signal.SIGINT])  # as a Ray worker
        out = []
        t = threading.Thread(target=spawn, args=(sys.argv[1] == "mask", out))
        t.start()
        t.join(90)
        print(json.dumps(out))
""")


def _run(tmp_path, mode: str) -> tuple[set[int], set[int], set[int]]:
    script = tmp_path / "spawn_from_thread.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), mode, engine.child_signals.__file__], capture_output=True,
                          text=True, timeout=120, cwd=str(tmp_path), env={"PATH": os.environ.get("PATH", "")})
    assert done.returncode == 0, done.stderr
    process, thread_after, child = json.loads(done.stdout.strip().splitlines()[-1])
    assert child is not None, done.stderr
    return set(process), set(thread_after), set(child)


@pytest.mark.parametrize("mode", ["mask", "plain"])
def test_a_core_spawned_from_an_unblocking_thread_blocks_what_its_process_blocks(tmp_path, mode):
    process, thread_after, child = _run(tmp_path, mode)
    held = {signal.SIGTERM, signal.SIGINT}
    assert held <= process  # the process's (main thread's) mask, read from the other thread
    assert not held & thread_after  # the spawning thread got its own mask back
    if mode == "mask":
        assert held <= child
    else:  # without it: nothing blocked (spawn's default; the reason for the module)
        assert not held & child
