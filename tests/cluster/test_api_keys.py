"""API keys (cluster.http.auth): the check on its own and the app config. Through a Serve app
with two ingress replicas and the official openai client: tests/cluster/test_serve_front_door.py."""

from __future__ import annotations

import pytest

from cluster.http.auth import ENV_VAR, ApiKeyCheck, digest, keys_from
from tests.cluster.helpers import ENGINE

KEYS = ("sk-first", "sk-second")


def test_keys_come_from_flags_and_the_environment_without_blanks_or_repeats():
    assert keys_from(["a", " b "], {ENV_VAR: "c, a,,"}) == ("a", "b", "c")
    assert keys_from(None, {}) == ()


def test_the_check_takes_any_configured_key_as_a_bearer_token_only():
    check = ApiKeyCheck(digest(k) for k in KEYS)
    assert check.allows("Bearer sk-first") and check.allows("bearer sk-second")
    for header in (None, "", "Bearer", "Bearer ", "Bearer sk-third", "Basic sk-first", "sk-first"):
        assert not check.allows(header), header
    assert ApiKeyCheck(()).allows(None)  # no keys configured: open


def test_app_config_never_shows_the_keys(tiny_model):
    from cluster.launch.app_config import AppConfig
    from engine import EngineArgs
    from engine.errors import ParameterError

    cfg = AppConfig(engine_args=EngineArgs(model=tiny_model, **ENGINE), api_keys=KEYS)
    assert "sk-first" not in repr(cfg)
    with pytest.raises(ParameterError, match="api_keys"):
        AppConfig(engine_args=EngineArgs(model=tiny_model, **ENGINE), api_keys="sk-first")
