"""Switches of the Serve processes that a Ray started by `pdserve serve` reads from its
environment (set before Ray starts; a cluster given in RAY_ADDRESS keeps what its `ray start`
had, and the manifests export the same values).

The Serve controller runs its control loop every 0.1 s by default, which made it the largest
idle CPU user of the server: 2.98 CPU-s per minute of ~11 with nothing to do (2-core machine,
colocated, tiny model; scripts/bench_server_cpu.py --idle-s). Every 0.5 s it used 1.28 and the
server 8.2. What the loop does (apply scale targets, notice a failed health check, push route
tables) then happens up to 0.4 s later: against replica starts of tens of seconds and health
checks every 5 s, nothing a user waits on.

Serve's throughput-optimised mode (`RAY_SERVE_THROUGHPUT_OPTIMIZED=1`, what Ray's docs ask for
with HAProxy for high-throughput serving): calls between deployments over gRPC straight to
the replica instead of Ray actor calls, user code and routers on the replica's own event loop
instead of a thread each, and the garbage collector frozen after start-up (its log buffering
is set back below). In P/D the ingress's prefill call is such a call, and its reply carries
the prompt KV (kvstore.handoff). Measured on the 2-core host (scripts/bench_server_cpu.py,
small preset, docs/benchmarks.md#serve-throughput-mode): P/D at concurrency 64 CPU outside the engines
0.20-0.24 ms per token against 0.27-0.29 and whole server 1.54-1.67x the offline engine
against 1.70-1.85x (at concurrency 8 within noise); colocated at concurrency 8 1.23-1.31x
against 1.42-1.58x.
"""

from __future__ import annotations

import os

from cluster.launch.http_proxy import MIN_DRAINING, MIN_DRAINING_S
from kvstore.handoff import GRPC_MAX_MESSAGE

CONTROL_LOOP = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
CONTROL_LOOP_S = "0.5"
THROUGHPUT = "RAY_SERVE_THROUGHPUT_OPTIMIZED"
# That mode also buffers the request path's log records (access lines included) by 1,000 and
# writes them only when the buffer is full or an error comes: an operator tailing the logs
# would see nothing for a thousand requests. Written as they come, as without the mode
# (`--disable-access-log` is what saves their cost).
LOG_BUFFER = "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE"
# Calls between deployments then travel over gRPC, whose client takes replies of up to 4 MiB
# by default: a prefill's reply carries the prompt's KV (kvstore.handoff; one 256-token prompt
# of SmolLM2 is 12 MB), so 128 MiB, and a KV bigger than that goes through the store.
GRPC_MAX_MESSAGE_BYTES = str(128 * 1024 * 1024)
# How long the controller waits for a starting proxy (HAProxy's manager, or Serve's proxy) to
# say it is ready; three misses in a row and it kills the proxy, and `serve.start` fails.
# Ray's 5 s is missed on a busy 2-core machine (measured: the HAProxy manager's first readiness
# answer took over 20 s while another Ray started replicas there), so 30 s.
PROXY_READY = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
PROXY_READY_S = "30"
# And it makes every HTTP replica a direct-ingress one, HAProxy or not, whose drain keeps it
# reachable for Ray's default 30 s: cluster.launch.http_proxy's 2 s then holds whatever the front.


def configure_serve_env(environ: dict | None = None) -> None:
    """Set pdserve's defaults; an operator's own values are kept."""
    env = os.environ if environ is None else environ
    env.setdefault(CONTROL_LOOP, CONTROL_LOOP_S)
    env.setdefault(THROUGHPUT, "1")
    env.setdefault(LOG_BUFFER, "1")
    env.setdefault(GRPC_MAX_MESSAGE, GRPC_MAX_MESSAGE_BYTES)
    env.setdefault(PROXY_READY, PROXY_READY_S)
    if env[THROUGHPUT] == "1":
        env.setdefault(MIN_DRAINING, MIN_DRAINING_S)
