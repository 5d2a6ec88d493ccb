"""The autoscaler on local Ray, following a synthetic load step: traffic against a tiny TTFT
target adds a prefill replica; when traffic stops and the latency windows empty, it removes
it again. Decode (ITL target far away, KV nearly empty) stays at its minimum throughout."""

from __future__ import annotations

import pytest
import requests

from tests.cluster.helpers import ENGINE, LoadThreads, assert_no_leaks, hf_text, wait_for

APP = "autotest"
NAME = "tiny-auto"
AUTOSCALE = {"enabled": True, "interval_s": 0.5, "ttft_p90_target_s": 0.001, "itl_p90_target_s": 10.0,
             "up_ticks": 2, "down_ticks": 3, "cooldown_ticks": 2, "look_back_period_s": 3.0,
             "max_replicas": {"prefill": 2, "decode": 2, "colocated": 1}}


@pytest.fixture(scope="module")
def app(deploy, tiny_model):
    from cluster.launch.app_config import AppConfig
    from engine import EngineArgs

    cfg = AppConfig(engine_args=EngineArgs(model=tiny_model, **ENGINE),
                    mode="pd", served_model_name=NAME, app_name=APP, replica_num_cpus=0,
                    max_replicas=2, autoscale=AUTOSCALE)
    return deploy(cfg)


def test_autoscaler_follows_a_load_step_up_and_down(app, tiny_model):
    def status():
        return requests.get(f"{app}/status", timeout=30).json()

    assert status()["autoscaling"] is True
    assert requests.post(f"{app}/scale", json={"prefill": 2}, timeout=30).status_code == 409  # it owns counts
    expected = hf_text(tiny_model, "load step", 4)
    answered = []

    def send(worker: int, i: int) -> None:
        # Anything but the right completion fails the thread, and so the test (a reset, a
        # timeout, a 5xx, a malformed or wrong 200), while replicas come and go.
        r = requests.post(f"{app}/v1/completions", json={
            "model": NAME, "prompt": "load step", "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200, (r.status_code, r.text)
        assert r.json()["choices"][0]["text"] == expected, r.text
        answered.append(worker)  # list.append is atomic

    with LoadThreads(send, 2, join_timeout_s=60) as load:
        up = wait_for(lambda: load.check() or ((s := status())["target"]["prefill"] == 2 and not s["scaling"]
                                               and len(s["prefill"]) == 2 and s),
                      "the autoscaler to add a prefill replica", 120, 0.25)
        assert up["target"]["decode"] == 1
    assert answered
    down = wait_for(lambda: (s := status())["target"]["prefill"] == 1 and not s["scaling"]
                    and len(s["prefill"]) == 1 and s, "the autoscaler to remove it when idle", 120, 0.25)
    assert down["target"]["decode"] == 1
    assert_no_leaks(app, APP, {"prefill", "decode"})
