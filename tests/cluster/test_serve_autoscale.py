"""The autoscaler on local Ray, following a synthetic load step: traffic against a tiny TTFT
target adds a prefill replica; when traffic stops and the latency windows empty, it removes
it again. Decode (ITL target far away, KV nearly empty) stays at its minimum throughout."""

from __future__ import annotations

import threading

import pytest
import requests

from tests.cluster.helpers import ENGINE, assert_no_leaks, wait_for

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


def test_autoscaler_follows_a_load_step_up_and_down(app):
    def status():
        return requests.get(f"{app}/status", timeout=30).json()

    assert status()["autoscaling"] is True
    assert requests.post(f"{app}/scale", json={"prefill": 2}, timeout=30).status_code == 409  # it owns counts
    stop = threading.Event()
    codes: list[int] = []

    def client():
        while not stop.is_set():
            r = requests.post(f"{app}/v1/completions", json={
                "model": NAME, "prompt": "load step", "max_tokens": 4, "temperature": 0}, timeout=60)
            codes.append(r.status_code)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        up = wait_for(lambda: (s := status())["target"]["prefill"] == 2 and not s["scaling"]
                      and len(s["prefill"]) == 2 and s, "the autoscaler to add a prefill replica", 120, 0.25)
        assert up["target"]["decode"] == 1
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert codes and set(codes) == {200}
    down = wait_for(lambda: (s := status())["target"]["prefill"] == 1 and not s["scaling"]
                    and len(s["prefill"]) == 1 and s, "the autoscaler to remove it when idle", 120, 0.25)
    assert down["target"]["decode"] == 1
    assert_no_leaks(app, APP, {"prefill", "decode"})
