"""The signal mask of an engine core process spawned in a server replica.

A spawned child does not keep the mask of the process that spawns it (multiprocessing's spawn
starts it with nothing blocked), while a server replica (like every Ray worker pdserve starts)
blocks SIGTERM and SIGINT, so that a signal to the whole process group (systemd's stop,
`kill -- -PGID`) reaches only the driver, which drains the app. A core that did not block them
would die at once instead, and take its requests with it. So the parent reads its process's
mask (its main thread's: Serve runs parts of a replica on threads that block nothing) and the
core applies it first thing; it then stops when its front end tells it, or when its pipe
closes. (Until then, while the spawned interpreter imports the engine, a group signal still
ends it: only while it starts, before it holds any request.)

Tensor-parallel ranks of the "mp" executor are left alone: they are daemonic, and
multiprocessing ends daemonic children at exit with SIGTERM before joining them.
"""

from __future__ import annotations

import signal


def process_blocked_signals() -> set[int]:
    """The signals this process's main thread blocks (Linux /proc), else the calling thread's."""
    try:
        with open("/proc/self/status") as f:  # the thread group leader's view
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
    except (OSError, StopIteration, ValueError):
        return set(signal.pthread_sigmask(signal.SIG_BLOCK, []))
    return {s for s in signal.valid_signals() if mask >> (s - 1) & 1}


def apply_blocked_signals(blocked: set[int] | None) -> None:
    """In the child: block exactly `blocked` (None: leave its mask as it started)."""
    if blocked is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
