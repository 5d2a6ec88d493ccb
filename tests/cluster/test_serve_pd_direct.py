"""P/D with --direct-streaming: every ingress replica is a decode replica (the engine's front
end in the replica, its core in a child process whose KV connector relays transfers through
the replica: kvstore.transports.relay), and prompts prefill on the Prefill deployment. Here
the prefill replicas run their cores in child processes too (--engine-core-process), so their
exports take the relay as well. Driven by the official openai client; oracles: Hugging Face
greedy text, the non-streamed answer, the processes' pids, Serve's deployment list, the KV
connector's counters (the prompt KV loaded, never recomputed, and handed back in the
prefill's reply, never through the store), and the replicas' KV figures and the store's
transfers (no leak). A dead core on either side is a 5xx and a replaced
replica, never a hang or a wrong 200."""

from __future__ import annotations

import pytest
import requests

from tests.cluster.helpers import (
    DIRECT_APP,
    DIRECT_NAME,
    assert_no_leaks,
    assert_plain_and_streamed_answer,
    engine_core_of,
    hf_text,
    kill_core_then_answers_again,
    metric_value,
    openai_client,
    replicas,
    wait_for,
)

APP, NAME = DIRECT_APP, DIRECT_NAME
PROMPT = "The river ran quietly past"
ROLES = {"prefill", "decode"}


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return tiny_model


@pytest.fixture(scope="module")
def app(shared_direct_app):
    # Every prompt of more than DIRECT_SHORT tokens disaggregated (all of this module's):
    # tests/cluster/helpers.py shared_direct_app_config.
    return shared_direct_app.url()


def test_the_ingress_is_the_decode_replica_and_loads_the_prompt_kv_from_its_core_process(app, model):
    import ray
    from ray import serve

    from kvstore.store_actor import STORE_NAMESPACE, store_name

    assert set(serve.status().applications[APP].deployments) == {"Prefill", "Ingress", "Coordinator"}
    # The prefill's reply (with the prompt KV) travels over gRPC, as under `pdserve serve`
    # (cluster.launch.serve_env), though this test process built the app without that switch.
    ingress = serve.get_deployment_handle("Ingress", APP)
    assert ingress.inter_deployment_calls.remote().result(timeout_s=30) == "grpc"
    engine_core_of("Ingress", APP)
    engine_core_of("Prefill", APP)
    loads = metric_value(app, "pdserve:kv_transfer_loads_total", role="decode")
    failures = metric_value(app, "pdserve:kv_transfer_load_failures_total", role="decode")
    exports = metric_value(app, "pdserve:kv_transfer_exports_total", role="prefill")
    store = ray.get_actor(store_name(APP), namespace=STORE_NAMESPACE)
    registered = ray.get(store.stats.remote())["registered"]
    client = openai_client(app)
    assert_plain_and_streamed_answer(client, NAME, PROMPT, hf_text(model, PROMPT, 10))
    assert {r["role"] for r in replicas(app)} == ROLES
    assert_no_leaks(app, APP, ROLES)  # blocks on both sides, and no live transfer in the store
    # Both prompts' KV crossed from the prefill core to the decode core (never recomputed).
    wait_for(lambda: metric_value(app, "pdserve:kv_transfer_loads_total", role="decode") - loads >= 2,
             "the decode replica to report two KV loads", 30, 0.2)
    # Against the counts before this test: the other modules on the shared app sent prompts
    # and killed cores mid-transfer.
    assert metric_value(app, "pdserve:kv_transfer_load_failures_total", role="decode") == failures
    assert metric_value(app, "pdserve:kv_transfer_exports_total", role="prefill") - exports >= 2
    # The KV came back in the prefill's reply to the ingress, its decode engine's host
    # (kvstore.handoff): the store saw none of it.
    assert ray.get(store.stats.remote())["registered"] == registered


def test_a_client_leaving_mid_stream_aborts_the_request_and_frees_its_kv_blocks(app):
    url = f"{app}/v1/completions"
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    steps = "pdserve:engine_steps_total"
    before = metric_value(app, steps, role="decode")
    with requests.post(url, json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        assert next(line for line in r.iter_lines() if line.startswith(b"data: {"))  # it is running
    assert_no_leaks(app, APP, ROLES)
    assert metric_value(app, steps, role="decode") - before < 400


def test_a_killed_decode_core_loses_no_request_then_serve_replaces_the_ingress_replica(app, model):
    kill_core_then_answers_again(app, "Ingress", APP, NAME, PROMPT, hf_text(model, PROMPT, 10))
    engine_core_of("Ingress", APP)  # the new replica runs its own core
    assert_no_leaks(app, APP, ROLES)


def test_a_killed_prefill_core_loses_no_request_then_serve_replaces_the_prefill_replica(app, model):
    kill_core_then_answers_again(app, "Prefill", APP, NAME, PROMPT, hf_text(model, PROMPT, 10))
    engine_core_of("Prefill", APP)
    assert_no_leaks(app, APP, ROLES)


# Last: it scales the shared app up and back (test_serve_spec asks it after this module).
def test_the_scale_api_scales_decode_as_ingress_replicas(app, model):
    from ray import serve

    client = openai_client(app)
    expected = hf_text(model, PROMPT, 10)
    r = requests.post(f"{app}/scale", json={"decode": 2}, timeout=60)
    try:
        assert r.status_code == 202, r.text

        def two():
            return serve.status().applications[APP].deployments["Ingress"].replica_states.get("RUNNING", 0) == 2
        wait_for(two, "two running ingress replicas", 180, 0.5)
        wait_for(lambda: len([x for x in replicas(app) if x["role"] == "decode"]) == 2,
                 "both decode engines to report", 60, 0.5)
        assert serve.status().applications[APP].deployments["Prefill"].replica_states.get("RUNNING", 0) == 1
        for _ in range(4):  # wherever the proxy sends them
            assert client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10,
                                             temperature=0).choices[0].text == expected
        assert_no_leaks(app, APP, ROLES)
    finally:
        # Back to one whatever failed above: the modules after this one ask the shared app.
        back = requests.post(f"{app}/scale", json={"decode": 1}, timeout=60)
    assert back.status_code == 202, back.text

    def settled():
        s = requests.get(f"{app}/status", timeout=30).json()
        return not s["scaling"] and len(s["decode"]) == 1 and len(s["prefill"]) == 1
    wait_for(settled, "one decode replica again", 180, 0.5)
    assert serve.status().applications[APP].deployments["Ingress"].replica_states == {"RUNNING": 1}
    assert client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10,
                                     temperature=0).choices[0].text == expected
