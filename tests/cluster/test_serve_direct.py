"""The Serve app with --direct-streaming: every ingress replica runs its own engine (front end
in the replica, core in a child process), with no engine deployment behind it. Driven by the
official openai client; oracles: Hugging Face greedy text, the non-streamed answer, the
replica's and its core's pids, Serve's own deployment list, and the replicas' KV figures (no
leak). A dead core is a 5xx and a replaced replica, never a hang or a wrong 200; the scale
API scales the ingress replicas, each with its engine."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from engine import EngineArgs
from tests.cluster.helpers import (
    ENGINE,
    answers_exactly,
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

APP = "direct"
NAME = "direct-model"
PROMPT = "The river ran quietly past"


@pytest.fixture(scope="module")
def model(model_factory) -> str:
    return model_factory("llama")


@pytest.fixture(scope="module")
def app(deploy, model):
    from cluster.launch.app_config import AppConfig

    cfg = AppConfig(engine_args=EngineArgs(model=model, **ENGINE), mode="colocated", direct_streaming=True,
                    served_model_name=NAME, app_name=APP, replica_num_cpus=0, max_replicas=2,
                    health_check_period_s=1.0)  # the kill test waits on failed checks
    return deploy(cfg)


def test_the_ingress_owns_its_engine_and_answers_like_transformers(app, model):
    from ray import serve

    deployments = set(serve.status().applications[APP].deployments)
    assert deployments == {"Ingress", "Coordinator"}  # no engine deployment behind the ingress
    engine_core_of("Ingress", APP)
    client = openai_client(app)
    assert_plain_and_streamed_answer(client, NAME, PROMPT, hf_text(model, PROMPT, 10))
    [rep] = replicas(app)
    assert rep["role"] == "colocated"
    assert metric_value(app, "vllm:generation_tokens_total", model_name=NAME) >= 20
    assert_no_leaks(app, APP, {"colocated"})  # waits for reports made after the requests
    assert metric_value(app, "vllm:num_requests_running", role="colocated", model_name=NAME) == 0.0


def test_streamed_samples_reassemble_to_the_whole_answer(app):
    client = openai_client(app)
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, n=2, logprobs=2)
    whole = client.completions.create(**kw)
    texts, tokens = {0: "", 1: ""}, {0: [], 1: []}
    with client.completions.create(stream=True, **kw) as s:
        for chunk in s:
            for c in chunk.choices:
                texts[c.index] += c.text
                tokens[c.index] += c.logprobs.tokens if c.logprobs else []
    for c in whole.choices:
        assert texts[c.index] == c.text and tokens[c.index] == c.logprobs.tokens


def test_a_client_leaving_mid_stream_aborts_the_request_and_frees_its_kv_blocks(app):
    url = f"{app}/v1/completions"
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    steps = "pdserve:engine_steps_total"  # forward passes of the engine (one token each here)
    before = metric_value(app, steps, role="colocated")
    with requests.post(url, json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith(b"data: {"))  # it is running
    # Closed after one chunk: the request is aborted in the engine, its blocks freed, and it
    # never reaches its 400 tokens.
    assert_no_leaks(app, APP, {"colocated"})
    assert metric_value(app, steps, role="colocated") - before < 400


def test_a_killed_core_loses_no_request_then_serve_replaces_the_replica(app, model):
    kill_core_then_answers_again(app, "Ingress", APP, NAME, PROMPT, hf_text(model, PROMPT, 10))


# Last: it leaves the module's app with two replicas.
def test_the_scale_api_scales_the_ingress_replicas_each_with_its_engine(app, model):
    from ray import serve

    r = requests.post(f"{app}/scale", json={"colocated": 2}, timeout=60)
    assert r.status_code == 202, r.text

    def two():
        return serve.status().applications[APP].deployments["Ingress"].replica_states.get("RUNNING", 0) == 2
    wait_for(two, "two running ingress replicas", 180, 0.5)
    wait_for(lambda: len({x["replica"] for x in replicas(app)}) == 2, "both engines to report", 60, 0.5)
    steps = {x["replica"]: metric_value(app, "pdserve:engine_steps_total", replica=x["replica"])
             for x in replicas(app)}
    expected = hf_text(model, PROMPT, 10)
    client = openai_client(app)

    def burst_then_both_ran_some() -> bool:
        # Eight at once, so the proxy spreads them over both (once it routes to the new one);
        # every answer must be right wherever it ran.
        with ThreadPoolExecutor(8) as pool:  # a wrong answer fails at once; a 5xx tries again
            answered = all(list(pool.map(lambda _: answers_exactly(client, NAME, PROMPT, expected)(), range(8))))
        return answered and all(metric_value(app, "pdserve:engine_steps_total", replica=r) > n
                                for r, n in steps.items())
    wait_for(burst_then_both_ran_some, "both replicas' engines to have run requests", 60, 0.5)
    assert_no_leaks(app, APP, {"colocated"})
