"""Elastic scaling through the Coordinator on local Ray: 1/1 -> 2/2 -> 1/1 under continuous
load with no failed or wrong answer, then no KV block or transfer left; bad scale requests."""

from __future__ import annotations

import threading

import pytest
import requests

from tests.cluster.helpers import ENGINE, LoadThreads, assert_no_leaks, metric_value, wait_for
from tests.engine.hf_reference import hf_greedy

APP = "scaletest"
NAME = "tiny-scale"
PROMPTS = ["The river ran quietly past", "A good engineer measures before", "Hello! How can I help you",
           "Once upon a time there was"]


@pytest.fixture(scope="module")
def app(deploy, tiny_model):
    from cluster.launch.app_config import AppConfig
    from engine import EngineArgs

    cfg = AppConfig(engine_args=EngineArgs(model=tiny_model, **ENGINE),
                    mode="pd", served_model_name=NAME, app_name=APP, replica_num_cpus=0,
                    max_replicas=2, graceful_shutdown_timeout_s=30)
    return deploy(cfg)


def _status(app):
    return requests.get(f"{app}/status", timeout=30).json()


def _settled_at(app, n):
    s = _status(app)
    return not s["scaling"] and len(s["prefill"]) == n and len(s["decode"]) == n and s


@pytest.mark.parametrize("body,param", [
    ({"prefill": -1}, "prefill"), ({"decode": 1.5}, "decode"), ({"prefill": 3}, "prefill"),
    ({"prefill": "2"}, "prefill"), ({"colocated": 1}, "colocated"), ({}, None),
])
def test_bad_scale_requests_are_400(app, body, param):
    r = requests.post(f"{app}/scale", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


def test_malformed_scale_body_is_400(app):
    r = requests.post(f"{app}/scale", data=b"{prefill: 2", headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_status_shape(app):
    s = _status(app)
    assert set(s) >= {"prefill", "decode", "store", "scaling", "target"}
    assert s["target"] == {"prefill": 1, "decode": 1} and s["scaling"] is False
    assert set(s["store"]) >= {"live_transfers", "bytes"}
    assert {"replica", "running", "waiting", "free_blocks", "total_blocks"} <= set(s["prefill"][0])


def test_scale_up_and_down_under_load_loses_nothing(app, tiny_model):
    from transformers import AutoTokenizer

    from cluster.launch.cli import main

    tok = AutoTokenizer.from_pretrained(tiny_model)
    expected = [tok.decode(hf_greedy(tiny_model, [tok.encode(p)], 12)[0], skip_special_tokens=True)
                for p in PROMPTS]
    answered: list[int] = []  # the prompt index of each right answer
    lock = threading.Lock()

    def send(worker: int, i: int) -> None:
        # Anything but the right completion fails the thread, and so the test: a reset or a
        # timeout (raised by requests), a non-200, a 200 that is no completion, a wrong text.
        k = (worker + 3 * i) % 4
        r = requests.post(f"{app}/v1/completions", json={
            "model": NAME, "prompt": PROMPTS[k], "max_tokens": 12, "temperature": 0}, timeout=120)
        assert r.status_code == 200, (r.status_code, r.text)
        text = r.json()["choices"][0]["text"]
        assert text == expected[k], (PROMPTS[k], text, expected[k])
        with lock:
            answered.append(k)

    def served() -> int:
        with lock:
            return len(answered)

    with LoadThreads(send, 3) as load:
        wait_for(lambda: load.check() or served() >= 6, "traffic to flow", 60)
        r = requests.post(f"{app}/scale", json={"prefill": 2, "decode": 2}, timeout=60)
        assert r.status_code == 202 and r.json()["target"] == {"prefill": 2, "decode": 2}
        busy = requests.post(f"{app}/scale", json={"prefill": 1}, timeout=60)
        assert busy.status_code == 409 and busy.json()["error"]["code"] == 409
        wait_for(lambda: load.check() or _settled_at(app, 2), "2 prefill + 2 decode replicas running", 240, 0.5)
        # New replicas take traffic once healthy: both prefill replicas export KV.
        wait_for(lambda: load.check() or (all(v > 0 for v in _exports_per_prefill(app).values())
                                          and len(_exports_per_prefill(app)) == 2),
                 "both prefill replicas to serve", 120, 0.2)
        assert main(["scale", "--url", app, "--prefill", "1", "--decode", "1"]) == 0  # the CLI
        mark = served()
        wait_for(lambda: load.check() or _settled_at(app, 1), "back to 1 prefill + 1 decode", 240, 0.5)
        wait_for(lambda: load.check() or served() >= mark + 6, "traffic after the scale-down", 60)
    assert served() >= 12 and set(answered) == {0, 1, 2, 3}
    assert main(["status", "--url", app]) == 0
    assert_no_leaks(app, APP, {"prefill", "decode"})


def _exports_per_prefill(app) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{app}/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pdserve:kv_transfer_exports_total" and s.labels.get("role") == "prefill":
                out[s.labels["replica"]] = s.value
    return out


def test_metric_value_helper_sees_this_app(app):
    assert metric_value(app, "vllm:num_requests_running", role="decode") >= 0
