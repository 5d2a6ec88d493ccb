"""The HTTP front door of one deployed app, through Serve's HTTP proxy: API keys
(cluster.http.auth), vLLM's tokenizer routes (cluster.http.tokenize) and the request-body limits
(cluster/http/body_limits.py). Each part's own tests, without Serve, are in test_api_keys.py,
test_tokenize.py and test_http_bodies.py; they share this one app because an app start costs
13-17 s of two cores.

The app runs two ingress replicas (`api_server_count`), so the keys are checked by each, and
`/metrics` must show the requests of both whichever answers (it runs with metrics_without_key:
/metrics is open while every other route but /health needs the key). It is served under the
route prefix PREFIX, not `/`, so the key check must see the routed path. Its body limit is 1 MiB
and its body timeout 2 s, and Serve's proxy must hand a request to the app before its body
arrives."""

from __future__ import annotations

import http.client
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.cluster.helpers import ENGINE, metric_value, serve_logs, wait_for
from tests.cluster.raw_http import assert_openai_error, exchange, post_head

APP = "frontdoor"
NAME = "tiny-keys"
KEYS = ("sk-first", "sk-second")
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}
PREFIX = "/front"
CHAT_PATH = f"{PREFIX}/v1/chat/completions"
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def app(deploy, tiny_model):
    from cluster.launch.app_config import AppConfig
    from engine import EngineArgs

    cfg = AppConfig(engine_args=EngineArgs(model=tiny_model, **ENGINE), mode="colocated", served_model_name=NAME,
                    app_name=APP, replica_num_cpus=0, api_keys=KEYS, api_server_count=2,
                    max_request_body_bytes=MiB, request_body_timeout_s=2.0, metrics_without_key=True)
    return deploy(cfg, route_prefix=PREFIX)


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
        # Under the prefix, whether the line shows it or not.
        return [len(re.findall(r"POST \S*/v1/completions 200", t)) for t in serve_logs(APP, "Ingress")]

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
        for path in ("/v1/models", "/docs", "/openapi.json", "/no-such-route"):
            assert requests.get(f"{app}{path}", headers=headers, timeout=30).status_code == 401, path
    assert app.endswith(PREFIX)  # all of the above under the prefix
    assert requests.get(f"{app}/health", timeout=30).status_code == 200  # load balancers need no key
    assert requests.get(f"{app}/metrics", timeout=30).status_code == 200  # metrics_without_key
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


def test_http_tokenize_then_detokenize_gives_the_text_back_and_counts_as_chat(app, tiny_model):
    from openai import OpenAI
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    r = requests.post(f"{app}/tokenize", json={"model": NAME, "prompt": TEXT}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tok(TEXT)["input_ids"] and r.json()["max_model_len"] == ENGINE["max_model_len"]
    back = requests.post(f"{app}/detokenize", json={"tokens": r.json()["tokens"]}, headers=AUTH, timeout=30)
    assert back.json() == {"prompt": TEXT}

    counted = requests.post(f"{app}/tokenize", json={"messages": CONVERSATION}, headers=AUTH, timeout=30).json()
    chat = OpenAI(base_url=f"{app}/v1", api_key=KEYS[0], max_retries=0).chat.completions.create(
        model=NAME, messages=CONVERSATION, max_tokens=1)
    assert counted["count"] == chat.usage.prompt_tokens
    assert counted["tokens"] == tok.apply_chat_template(CONVERSATION, add_generation_prompt=True)["input_ids"]

    info = requests.get(f"{app}/tokenizer_info", headers=AUTH, timeout=30).json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template


def test_http_bad_bodies_are_openai_400s_naming_the_field(app, tiny_model):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tiny_model))
    for path, body, param in (("/detokenize", {"tokens": [1, vocab]}, "tokens"),
                              ("/detokenize", {"tokens": "1 2"}, "tokens"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, "messages")):
        r = requests.post(f"{app}{path}", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err
    r = requests.post(f"{app}/tokenize", json={"model": "gpt-4", "prompt": "x"}, headers=AUTH, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_http_tokenizer_routes_answer_401_without_the_key(app):
    for method, path, body in (("post", "/tokenize", {"prompt": "x"}), ("post", "/detokenize", {"tokens": [1]}),
                               ("get", "/tokenizer_info", None)):
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
            r = requests.request(method, f"{app}{path}", json=body, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        assert requests.request(method, f"{app}{path}", json=body, headers=AUTH, timeout=30).status_code == 200


# ---- the request-body limits through Serve's HTTP proxy (the app's 1 MiB and 2 s) ----------
def _port(url: str) -> int:
    return int(url.removesuffix(PREFIX).rsplit(":", 1)[1])


def test_through_serve_a_64_mib_declared_body_is_413_before_any_byte_of_it_is_sent(app):
    """Serve's proxy hands the request to the ingress replica before the body arrives (it
    forwards the body as the app reads it), so the app's 413 comes back with no body sent."""
    start = time.monotonic()
    status, headers, body, closed = exchange(_port(app), post_head(_port(app), 64 * MiB, CHAT_PATH, headers=AUTH))
    assert status == 413 and headers["connection"] == "close" and closed
    assert_openai_error(body, 413, str(64 * MiB), str(MiB))  # the app's own limit, not the default
    assert time.monotonic() - start < 10.0


def test_through_serve_a_chunked_body_over_the_apps_limit_is_413(app):
    piece = b"x" * (256 * 1024)
    chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"
    status, headers, body, closed = exchange(_port(app), post_head(_port(app), None, CHAT_PATH, headers=AUTH), chunk * 5)
    assert status == 413 and closed
    assert_openai_error(body, 413, f"over {MiB} bytes")


def test_through_serve_a_body_that_stops_arriving_is_408_at_the_apps_bound(app):
    start = time.monotonic()
    status, _, body, closed = exchange(_port(app), post_head(_port(app), 100, CHAT_PATH, headers=AUTH), b'{"model": "m"')
    assert status == 408 and closed
    assert_openai_error(body, 408, "within 2 s")
    assert 2.0 <= time.monotonic() - start < 20.0


def test_through_serve_a_keep_alive_connection_stays_usable_after_a_4xx(app):
    conn = http.client.HTTPConnection("127.0.0.1", _port(app), timeout=60)
    conn.connect()
    sock = conn.sock
    headers = {"Content-Type": "application/json", **AUTH}
    for bad, status in ((b'{"model": ', 400), (json.dumps({**CHAT, "messages": [{"role": "user"}]}), 400),
                        (json.dumps({**CHAT, "model": "other"}), 404)):
        conn.request("POST", CHAT_PATH, body=bad, headers=headers)
        r = conn.getresponse()
        assert r.status == status and "error" in json.loads(r.read())
        conn.request("POST", CHAT_PATH, body=json.dumps(CHAT), headers=headers)
        ok = conn.getresponse()
        assert ok.status == 200 and json.loads(ok.read())["usage"]["completion_tokens"] == 2
        assert conn.sock is sock
    conn.close()
