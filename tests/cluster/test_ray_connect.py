"""Reaching Ray (cluster.launch.ray_connect): bounded, never waiting on a dead cluster, one-line errors."""

from __future__ import annotations

import socket

import pytest

from cluster.launch.ray_connect import RayConnectError, resolve_address, token_available


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


@pytest.fixture
def listener():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield f"127.0.0.1:{s.getsockname()[1]}"
    s.close()


def test_an_address_where_nothing_listens_is_one_clear_error(tmp_path):
    address = f"127.0.0.1:{_closed_port()}"
    with pytest.raises(RayConnectError, match=rf"cannot reach the Ray cluster at {address} \(RAY_ADDRESS\)"):
        resolve_address({"RAY_ADDRESS": address}, tmp_path / "none", timeout_s=2.0)


def test_a_malformed_address_names_the_variable(tmp_path):
    with pytest.raises(RayConnectError, match="RAY_ADDRESS='headnode' is not host:port"):
        resolve_address({"RAY_ADDRESS": "headnode"}, tmp_path / "none")


def test_a_live_address_is_used(listener, tmp_path):
    assert resolve_address({"RAY_ADDRESS": listener}, tmp_path / "none") == listener
    assert resolve_address({"RAY_ADDRESS": "ray://head:10001"}, tmp_path / "none") == "ray://head:10001"


def test_without_an_address_a_dead_recorded_cluster_is_skipped_and_a_live_one_joined(listener, tmp_path):
    recorded = tmp_path / "ray_current_cluster"
    assert resolve_address({}, recorded) == "local"  # nothing recorded
    recorded.write_text(f"127.0.0.1:{_closed_port()}\n")
    assert resolve_address({}, recorded) == "local"  # recorded but gone: start a fresh one
    recorded.write_text(listener)
    assert resolve_address({}, recorded) == listener


def test_a_token_is_found_where_ray_looks_for_it(tmp_path):
    assert token_available({"RAY_AUTH_TOKEN": "t"}, tmp_path)
    assert not token_available({}, tmp_path)
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t")
    assert token_available({}, tmp_path)
    assert not token_available({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")}, tmp_path)
