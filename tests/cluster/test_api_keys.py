"""API keys (cluster.http.auth): the check on its own, and through a Serve app with the official
openai client. The app runs two ingress replicas (`api_server_count`), so the keys are
checked by each, and `/metrics` must show the requests of both whichever answers. The
tokenizer routes through an app are asked here too (one app start fewer)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from cluster.http.auth import ENV_VAR, ApiKeyCheck, digest, keys_from
from tests.cluster.helpers import ENGINE, metric_value, serve_logs, wait_for

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
    from cluster.launch.app_config import AppConfig
    from engine import EngineArgs
    from engine.errors import ParameterError

    cfg = AppConfig(engine_args=EngineArgs(model=tiny_model, **ENGINE), api_keys=KEYS)
    assert "sk-first" not in repr(cfg)
    with pytest.raises(ParameterError, match="api_keys"):
        AppConfig(engine_args=EngineArgs(model=tiny_model, **ENGINE), api_keys="sk-first")


@pytest.fixture(scope="module")
def app(deploy, tiny_model):
    from cluster.launch.app_config import AppConfig
    from engine import EngineArgs

    cfg = AppConfig(engine_args=EngineArgs(model=tiny_model, **ENGINE), mode="colocated", served_model_name=NAME,
                    app_name=APP, replica_num_cpus=0, api_keys=KEYS, api_server_count=2)
    return deploy(cfg)


def test_metrics_count_the_requests_of_every_ingress_replica_whichever_answers(app):
    """First in the module: nothing was counted before. 24 requests, 6 at a time, spread by
    Serve over the two ingress replicas; every scrape (each reaches either replica) must
    then count all of them, never fewer than the last one did."""
    from ray import serve

    assert serve.status().applications[APP].deployments["Ingress"].replica_states == {"RUNNING": 2}
    auth = {"Authorization": f"Bearer {KEYS[0]}"}

    def one(i):
        r = requests.post(f"{app}/v1/completions", headers=auth, timeout=60, json={
            "model": NAME, "prompt": f"request {i}", "max_tokens": 2, "stream": i % 2 == 0})
        assert r.status_code == 200, r.text
        return r.text

    with ThreadPoolExecutor(6) as pool:
        assert all(pool.map(one, range(24)))

    def served():  # per replica, from its access lines (written once each response went out)
        return [t.count("POST /v1/completions 200") for t in serve_logs(APP, "Ingress")]

    wait_for(lambda: sum(served()) == 24, "the ingress replicas' access lines", timeout_s=30)
    assert len(served()) == 2 and min(served()) > 0, served()  # both replicas took some

    def ok_count():
        return metric_value(app, "pdserve:requests_total", status="ok")

    # The replica that answers a scrape counts itself now, the other as of its last push (2 s).
    wait_for(lambda: ok_count() == 24, "both ingress replicas' requests in /metrics", timeout_s=30, interval_s=0.5)
    counts = [ok_count() for _ in range(8)]
    assert counts == [24] * 8
    assert metric_value(app, "vllm:e2e_request_latency_seconds_count") == 24
    # Either replica answers /v1/models alike (its `created` is the app's, not the replica's).
    models = {requests.get(f"{app}/v1/models", headers=auth, timeout=30).text for _ in range(8)}
    assert len(models) == 1, models


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


# ---- vLLM's tokenizer routes through this app (cluster.http.tokenize; its own tests are in
# tests/cluster/test_tokenize.py), behind the keys like /v1/* ------------------------------
TEXT = "The river ran past the old mill."
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
TOK_AUTH = {"Authorization": f"Bearer {KEYS[0]}"}


def test_http_tokenize_then_detokenize_gives_the_text_back_and_counts_as_chat(app, tiny_model):
    from openai import OpenAI
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    r = requests.post(f"{app}/tokenize", json={"model": NAME, "prompt": TEXT}, headers=TOK_AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tok(TEXT)["input_ids"] and r.json()["max_model_len"] == ENGINE["max_model_len"]
    back = requests.post(f"{app}/detokenize", json={"tokens": r.json()["tokens"]}, headers=TOK_AUTH, timeout=30)
    assert back.json() == {"prompt": TEXT}

    counted = requests.post(f"{app}/tokenize", json={"messages": CONVERSATION}, headers=TOK_AUTH, timeout=30).json()
    chat = OpenAI(base_url=f"{app}/v1", api_key=KEYS[0], max_retries=0).chat.completions.create(
        model=NAME, messages=CONVERSATION, max_tokens=1)
    assert counted["count"] == chat.usage.prompt_tokens
    assert counted["tokens"] == tok.apply_chat_template(CONVERSATION, add_generation_prompt=True)["input_ids"]

    info = requests.get(f"{app}/tokenizer_info", headers=TOK_AUTH, timeout=30).json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template


def test_http_bad_bodies_are_openai_400s_naming_the_field(app, tiny_model):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tiny_model))
    for path, body, param in (("/detokenize", {"tokens": [1, vocab]}, "tokens"),
                              ("/detokenize", {"tokens": "1 2"}, "tokens"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, "messages")):
        r = requests.post(f"{app}{path}", json=body, headers=TOK_AUTH, timeout=30)
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err
    r = requests.post(f"{app}/tokenize", json={"model": "gpt-4", "prompt": "x"}, headers=TOK_AUTH, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_http_tokenizer_routes_answer_401_without_the_key(app):
    for method, path, body in (("post", "/tokenize", {"prompt": "x"}), ("post", "/detokenize", {"tokens": [1]}),
                               ("get", "/tokenizer_info", None)):
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
            r = requests.request(method, f"{app}{path}", json=body, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        assert requests.request(method, f"{app}{path}", json=body, headers=TOK_AUTH, timeout=30).status_code == 200
