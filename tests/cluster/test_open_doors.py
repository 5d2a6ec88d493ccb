"""An app without API keys is not served on an address other machines can reach
(cluster/launch/open_doors.py), unless the operator opts out."""

from __future__ import annotations

import pytest

from cluster.launch.open_doors import check_open_admin, is_loopback
from engine.errors import ParameterError


def test_only_loopback_addresses_count_as_this_machine():
    for host in ("127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.5", "192.168.1.2", "example.com", "my-head-node"):
        assert not is_loopback(host), host


def test_no_keys_on_a_reachable_host_is_refused_naming_the_ways_out():
    with pytest.raises(ParameterError) as e:
        check_open_admin(has_keys=False, allowed=False, http_host="0.0.0.0")
    assert e.value.field == "api_keys"
    for way_out in ("PDSERVE_API_KEY", "127.0.0.1", "allow_unauthenticated_admin: true", "POST /scale"):
        assert way_out in str(e.value), way_out
    check_open_admin(has_keys=True, allowed=False, http_host="0.0.0.0")  # keys
    check_open_admin(has_keys=False, allowed=True, http_host="0.0.0.0")  # the explicit opt-out
    check_open_admin(has_keys=False, allowed=False, http_host="127.0.0.1")  # this machine only
    check_open_admin(has_keys=False, allowed=False, http_host=None)  # unknown: a warning, not a refusal


def test_pdserve_serve_refuses_a_reachable_host_without_keys_before_ray_starts(tiny_model, monkeypatch):
    from cluster.launch.cli import build_parser
    from cluster.launch.serve_cli import _config

    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)

    def config(*flags):
        return _config(build_parser().parse_args(["serve", "--model", tiny_model, *flags]))

    with pytest.raises(ParameterError, match="Serve listens on '0.0.0.0'"):
        config("--host", "0.0.0.0")
    assert config("--host", "0.0.0.0", "--api-key", "sk-1").api_keys == ("sk-1",)
    assert config("--host", "0.0.0.0", "--allow-unauthenticated-admin").allow_unauthenticated_admin
    assert not config().api_keys  # the default host, 127.0.0.1



def test_asking_for_serves_host_never_starts_a_ray():
    """Building an app without Ray (unit tests, a config check) must not start one: a Ray
    started by accident would stand in the way of the real one."""
    import subprocess
    import sys

    code = ("import ray; from cluster.launch.open_doors import serve_http_host; "
            "assert serve_http_host() is None and not ray.is_initialized(); print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=__file__.rsplit("/tests/", 1)[0])
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
