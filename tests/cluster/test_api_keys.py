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


def _answer(path: str, root_path: str = "", authorization: str | None = None, metrics_without_key=False) -> int:
    """The status the key check gives a GET of `path` (the app behind it answers 200)."""
    import asyncio

    from cluster.http.auth import _ApiKeyMiddleware

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    check = ApiKeyCheck((digest(k) for k in KEYS), metrics_without_key)
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    scope = {"type": "http", "method": "GET", "path": path, "root_path": root_path, "headers": headers,
             "query_string": b""}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(_ApiKeyMiddleware(app, lambda: check)(scope, receive, send))
    return sent[0]["status"]


@pytest.mark.parametrize("root_path", ["", "/pfx"])
def test_every_route_but_health_needs_the_key_under_any_route_prefix(root_path):
    for path in ("/v1/models", "/v1/chat/completions", "/tokenize", "/detokenize", "/tokenizer_info", "/scale",
                 "/status", "/metrics", "/docs", "/openapi.json", "/v1/load_lora_adapter", "/no-such-route", "/"):
        assert _answer(root_path + path, root_path) == 401, path
        assert _answer(root_path + path, root_path, "Bearer sk-second") == 200, path
    assert _answer(root_path + "/health", root_path) == 200


def test_metrics_is_open_only_when_asked_and_a_prefix_is_no_way_around_the_key():
    assert _answer("/metrics", metrics_without_key=True) == 200
    assert _answer("/pfx/metrics", "/pfx", metrics_without_key=True) == 200
    assert _answer("/scale", metrics_without_key=True) == 401
    # A path under another prefix than the app's is not the app's /health.
    assert _answer("/other/health", "/pfx") == 401
