"""API keys (cluster.auth): the check on its own, and through a Serve app with the official
openai client."""

from __future__ import annotations

import pytest
import requests

from cluster.auth import ENV_VAR, ApiKeyCheck, digest, keys_from
from tests.cluster.helpers import ENGINE

APP = "keytest"
NAME = "tiny-keys"
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
    from cluster.app import AppConfig
    from engine import EngineArgs
    from engine.errors import ParameterError

    cfg = AppConfig(engine_args=EngineArgs(model=tiny_model, **ENGINE), api_keys=KEYS)
    assert "sk-first" not in repr(cfg)
    with pytest.raises(ParameterError, match="api_keys"):
        AppConfig(engine_args=EngineArgs(model=tiny_model, **ENGINE), api_keys="sk-first")


@pytest.fixture(scope="module")
def app(deploy, tiny_model):
    from cluster.app import AppConfig
    from engine import EngineArgs

    cfg = AppConfig(engine_args=EngineArgs(model=tiny_model, **ENGINE), mode="colocated", served_model_name=NAME,
                    app_name=APP, replica_num_cpus=0, api_keys=KEYS)
    return deploy(cfg)


def test_serve_app_answers_401_without_a_valid_key_and_serves_with_one(app):
    from openai import AuthenticationError, OpenAI

    body = {"model": NAME, "prompt": "Hello", "max_tokens": 3}
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        r = requests.post(f"{app}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key" and "sk-" not in r.text
        assert requests.get(f"{app}/status", headers=headers, timeout=30).status_code == 401
        assert requests.post(f"{app}/scale", json={"colocated": 1}, headers=headers, timeout=30).status_code == 401
    assert requests.get(f"{app}/health", timeout=30).status_code == 200  # load balancers need no key
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{app}/v1", api_key="sk-wrong", max_retries=0).models.list()
    client = OpenAI(base_url=f"{app}/v1", api_key=KEYS[1], max_retries=0)
    assert client.completions.create(**body, temperature=0).usage.completion_tokens == 3
    chunks = list(client.completions.create(**body, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    status = requests.get(f"{app}/status", headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=30)
    assert status.status_code == 200 and "sk-" not in status.text
