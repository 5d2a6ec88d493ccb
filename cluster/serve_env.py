"""Switches of the Serve processes that a Ray started by `pdserve serve` reads from its
environment (set before Ray starts; a cluster given in RAY_ADDRESS keeps what its `ray start`
had, and the manifests export the same values).

The Serve controller runs its control loop every 0.1 s by default, which made it the largest
idle CPU user of the server: 2.98 CPU-s per minute of ~11 with nothing to do (2-core machine,
colocated, tiny model; scripts/bench_server_cpu.py --idle-s). Every 0.5 s it used 1.28 and the
server 8.2. What the loop does (apply scale targets, notice a failed health check, push route
tables) then happens up to 0.4 s later: against replica starts of tens of seconds and health
checks every 5 s, nothing a user waits on.
"""

from __future__ import annotations

import os

CONTROL_LOOP = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
CONTROL_LOOP_S = "0.5"


def configure_serve_env(environ: dict | None = None) -> None:
    """Set pdserve's defaults; an operator's own values are kept."""
    env = os.environ if environ is None else environ
    env.setdefault(CONTROL_LOOP, CONTROL_LOOP_S)
