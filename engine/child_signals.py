"""The signal mask of a process the engine spawns (an engine core, a tensor-parallel rank).

A spawned child starts with the mask of the thread that started it, which is not always the
process's: Serve runs a replica's constructor on a thread of its own that blocks nothing,
while the replica process (like every Ray worker pdserve starts) blocks SIGTERM and SIGINT so
that a signal to the whole process group (systemd's stop, `kill -- -PGID`) reaches only the
driver, which drains the app. A child started from that thread would die at once instead, and
take its requests with it. So the parent reads the mask of its process (its main thread's)
and the child applies it first thing: it then stops when its parent tells it (or goes away),
as the parent itself does.
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
    """In the child: block exactly `blocked` (None: leave the inherited mask)."""
    if blocked is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
