"""The Serve app in colocated mode (the baseline): the engine deployment behind the ingress
(test_serve_direct: without), with a pending-request limit of 2 so the 429 path can be reached
with requests the test holds open, and --engine-core-process: the replica's engine core runs
in a child process of the replica (as vLLM V1's EngineCoreProc). Driven by requests and the
official openai client. Oracles: Hugging Face greedy text, the replica's and its core's pids,
/proc, Serve's logs and the replica's KV figures (no leak). Nothing may outlive what it belongs
to, and a dead core is a 5xx and a replaced replica, never a hang or a wrong 200. (An engine in
the replica's own thread behind an ingress is what test_serve_front_door's app runs, asked
there for API keys, the tokenizer routes and body limits.)"""

from __future__ import annotations

import os
import signal
import uuid

import pytest
import requests

from engine import EngineArgs
from engine.errors import ParameterError
from tests.cluster import structured_checks
from tests.cluster.helpers import (
    ENGINE,
    answers_exactly,
    assert_no_leaks,
    assert_plain_and_streamed_answer,
    deployment_processes,
    engine_core_of,
    hf_text,
    in_thread,
    kill_core_then_answers_again,
    metric_value,
    openai_client,
    proc_stat,
    running,
    serve_logs,
    sse_events,
    wait_for,
)
from tests.engine.hf_reference import hf_greedy

APP = "colotest"
NAME = "tiny-colo"
PROMPT = "The river ran quietly past"


@pytest.fixture(scope="module")
def app(deploy, tiny_model):
    from cluster.launch.app_config import AppConfig

    cfg = AppConfig(engine_args=EngineArgs(model=tiny_model, engine_core_process=True, **ENGINE),
                    mode="colocated", served_model_name=NAME, app_name=APP,
                    replica_num_cpus=0, max_pending_requests=2, direct_streaming=False,
                    health_check_period_s=1.0)  # the kill tests wait on failed checks
    return deploy(cfg)


def _open_stream(app, max_tokens=450):
    """A streamed request held open by the test (it has read its first event)."""
    body = {"model": NAME, "prompt": "Hold this stream open", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    r = requests.post(f"{app}/v1/completions", json=body, stream=True, timeout=60)
    assert r.status_code == 200
    lines = r.iter_lines()
    assert next(line for line in lines if line.startswith(b"data: "))
    return r


def test_colocated_greedy_equals_hf(app, tiny_model):
    from openai import OpenAI
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    client = OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0)
    for prompt in ["The river ran quietly past", "Once upon a time"]:
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0)
        expected = tok.decode(hf_greedy(tiny_model, [tok.encode(prompt)], 20)[0], skip_special_tokens=True)
        assert r.choices[0].text == expected
    status = requests.get(f"{app}/status", timeout=10).json()
    assert status["target"] == {"colocated": 1} and len(status["colocated"]) == 1


def _serve_log_text(deployment: str) -> str:
    return "".join(serve_logs(APP, deployment))


def test_access_log_has_the_http_requests_and_none_of_the_internal_calls(app):
    """The ingress logs each HTTP request (as uvicorn does in vLLM); the engine replica's
    per-request submit calls and the coordinator's calls are not logged (cluster.launch.app)."""
    request_id = f"access-log-{uuid.uuid4().hex}"
    r = requests.post(f"{app}/v1/completions", headers={"X-Request-Id": request_id},
                      json={"model": NAME, "prompt": "Log me", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    # Serve writes the line once the response has gone out: bounded wait for it.
    wait_for(lambda: f"{request_id} -- POST /v1/completions 200" in _serve_log_text("Ingress"),
             "the ingress's access line", timeout_s=30)
    engine_log = _serve_log_text("Colocated")
    assert engine_log, "the engine replica's Serve log exists"
    assert "CALL submit" not in engine_log and request_id not in engine_log
    assert "CALL " not in _serve_log_text("Coordinator")


def test_n_choices_stream_and_whole_agree_and_equal_the_seeded_singles(app, tiny_model):
    """`n`=2 through the official client: greedy choices both equal HF; sampled choice j is the
    n=1 request with seed+j (engine.parallel_sampling); the stream reassembles, per index, to
    the non-streamed response; usage counts the prompt once."""
    from openai import OpenAI
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    client = OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0)
    prompt = "The river ran quietly past"
    greedy = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0, n=2)
    expected = tok.decode(hf_greedy(tiny_model, [tok.encode(prompt)], 10)[0], skip_special_tokens=True)
    assert [(c.index, c.text) for c in greedy.choices] == [(0, expected), (1, expected)]
    single = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0)
    assert greedy.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt once, as OpenAI
    assert greedy.usage.completion_tokens == 2 * single.usage.completion_tokens

    sampled = dict(model=NAME, max_tokens=12, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    messages = [{"role": "user", "content": "Tell me a story"}]
    whole = client.chat.completions.create(messages=messages, n=2, **sampled)
    singles = [client.chat.completions.create(messages=messages, **{**sampled, "seed": 11 + j})
               for j in range(2)]
    assert [c.message.content for c in whole.choices] == [s.choices[0].message.content for s in singles]
    assert len({c.message.content for c in whole.choices}) == 2  # seeds 11 and 12 differ
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.usage.prompt_tokens == singles[0].usage.prompt_tokens and whole.usage.completion_tokens == 24
    streamed = ["", ""]
    finish = [None, None]
    for chunk in client.chat.completions.create(messages=messages, n=2, stream=True, **sampled):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    assert streamed == [c.message.content for c in whole.choices]
    assert finish == ["length", "length"]
    assert_no_leaks(app, APP, {"colocated"})


CHAT_BAD = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),  # the field the client sent
    ({"max_completion_tokens": ENGINE["max_model_len"]}, "max_completion_tokens"),  # beyond the context
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "word " * 600}]}, "messages"),  # over the context
    ({"n": 0}, "n"),
    ({"n": 3}, "n"),  # 3 sequences > this app's max_pending_requests of 2
    # no name (tool_choice "none": this app refuses "auto" first, before any tool is parsed)
    ({"tools": [{"type": "function", "function": {"parameters": {}}}], "tool_choice": "none"}, "tools"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # auto: this app has no parser
    ({"temperature": -1}, "temperature"),
]
COMPLETION_BAD = [
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"best_of": 2}, "best_of"),
    ({"logprobs": 21}, "logprobs"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
]


@pytest.mark.parametrize("route,override,param", [("chat/completions", o, p) for o, p in CHAT_BAD]
                         + [("completions", o, p) for o, p in COMPLETION_BAD],
                         ids=[f"chat-{p}" for _, p in CHAT_BAD] + [f"cmpl-{p}" for _, p in COMPLETION_BAD])
def test_bad_inputs_are_400_naming_the_request_field(app, route, override, param):
    base = ({"messages": [{"role": "user", "content": "hi"}]} if route.startswith("chat")
            else {"prompt": "Hello there", "max_tokens": 4})
    r = requests.post(f"{app}/v1/{route}", json={"model": NAME, **base, **override}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_queue_limit_is_429_with_retry_after(app):
    """A burst of 8 long requests against a limit of 2 in flight: the first ones take hundreds
    of decode steps, so the rest of the burst (sent at once) finds the ingress full."""
    from concurrent.futures import ThreadPoolExecutor

    def send(i):
        return requests.post(f"{app}/v1/completions", json={
            "model": NAME, "prompt": f"burst {i}", "max_tokens": 300, "ignore_eos": True}, timeout=120)

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(send, range(8)))
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429} and codes.count(200) >= 2, codes
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and "retry" in err["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 300  # admitted ones are whole
    assert_no_leaks(app, APP, {"colocated"})
    # Capacity is back once the burst is over.
    r = requests.post(f"{app}/v1/completions", json={"model": NAME, "prompt": "again", "max_tokens": 2},
                      timeout=30)
    assert r.status_code == 200


def test_disconnect_aborts_and_frees(app):
    cancelled = metric_value(app, "pdserve:requests_total", status="cancelled")
    _open_stream(app).close()
    assert_no_leaks(app, APP, {"colocated"})
    assert metric_value(app, "pdserve:requests_total", status="cancelled") == cancelled + 1


def test_stream_runs_to_completion_after_others_leave(app):
    r = requests.post(f"{app}/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        stream=True, timeout=60)
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 6 and events[-2]["choices"] == []
    assert all("usage" in e for e in events[1:-1])  # continuous usage stats on every content chunk


def test_structured_outputs_colocated_valid_and_equal_to_offline(app, tiny_model):
    from openai import OpenAI

    client = OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0)
    structured_checks.check_every_spelling_constrains_sampled_completions(client, NAME)
    structured_checks.check_equals_offline(client, NAME, tiny_model, ENGINE)
    assert_no_leaks(app, APP, {"colocated"})


def test_the_replicas_core_is_its_child_and_answers_like_transformers(app, tiny_model):
    engine_core_of("Colocated", APP)
    client = openai_client(app)
    assert_plain_and_streamed_answer(client, NAME, PROMPT, hf_text(tiny_model, PROMPT, 10))
    assert_no_leaks(app, APP, {"colocated"})


def test_a_killed_core_loses_no_request_then_serve_replaces_the_replica(app, tiny_model):
    kill_core_then_answers_again(app, "Colocated", APP, NAME, PROMPT, hf_text(tiny_model, PROMPT, 10))


def test_a_killed_replica_takes_its_core_process_with_it(app, tiny_model):
    old = deployment_processes("Colocated", APP)
    [core] = old["engine_cores"]
    start = proc_stat(core)[19]  # so a reused pid is not taken for the core
    os.kill(old["replica"], signal.SIGKILL)
    # It must not outlive its replica: Ray ends a dead worker's children, and the core also
    # stops by itself when its pipe closes (tests/engine/test_engine_core_process.py).
    wait_for(lambda: not running(core, start), "the orphaned core process to exit", 60, 0.2)
    expected = hf_text(tiny_model, PROMPT, 10)
    wait_for(answers_exactly(openai_client(app), NAME, PROMPT, expected), "a replaced replica to answer", 180, 2.0)


def test_tensor_parallel_apps_refuse_the_core_process_before_anything_starts(tiny_model):
    from cluster.launch.app_config import AppConfig

    args = EngineArgs(model=tiny_model, engine_core_process=True)
    with pytest.raises(ParameterError, match="tensor_parallel_size=2") as e:
        AppConfig(engine_args=args, mode="pd", prefill_tensor_parallel_size=2, decode_tensor_parallel_size=2)
    assert e.value.field == "engine_core_process"


def test_deleting_the_app_lets_in_flight_requests_finish(app):
    """Graceful shutdown: a stream in flight when the app is deleted still runs to its end.
    (Last in this module: it removes the app.)"""
    from ray import serve

    r = requests.post(f"{app}/v1/completions", json={
        "model": NAME, "prompt": "Finish me", "max_tokens": 480, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}, stream=True, timeout=120)
    lines = r.iter_lines()
    assert next(line for line in lines if line.startswith(b"data: "))
    deleted = in_thread(serve.delete, APP)
    events = [line for line in lines if line.startswith(b"data: ")]
    deleted.result(timeout=120)  # serve.delete's own error, or a hang past the bound, fails here
    assert events[-1] == b"data: [DONE]"
    assert b'"completion_tokens":480' in events[-2]
