"""The Serve app with --engine-core-process: a colocated replica whose engine core runs in a
child process of the replica (as vLLM V1's EngineCoreProc), driven by the official openai
client. Oracles: Hugging Face greedy text, the replica's and its core's pids, /proc, and the
replica's KV figures (no leak). Nothing may outlive what it belongs to, and a dead core is a
5xx and a replaced replica, never a hang or a wrong 200."""

from __future__ import annotations

import os
import signal

import pytest

from engine import EngineArgs
from engine.errors import ParameterError
from tests.cluster.helpers import (
    ENGINE,
    answers_exactly,
    assert_no_leaks,
    deployment_processes,
    engine_core_of,
    hf_text,
    kill_core_then_answers_again,
    openai_client,
    proc_stat,
    running,
    wait_for,
)

APP = "coreproc"
NAME = "core-process"
PROMPT = "The river ran quietly past"


def _processes() -> dict:
    return deployment_processes("Colocated", APP)


@pytest.fixture(scope="module")
def model(model_factory) -> str:
    return model_factory("llama")


@pytest.fixture(scope="module")
def app(deploy, model):
    from cluster.launch.app_config import AppConfig

    cfg = AppConfig(engine_args=EngineArgs(model=model, engine_core_process=True, **ENGINE), mode="colocated",
                    direct_streaming=False, served_model_name=NAME, app_name=APP, replica_num_cpus=0,
                    health_check_period_s=1.0)  # the kill tests wait on failed checks
    return deploy(cfg)


def test_the_replicas_core_is_its_child_and_answers_like_transformers(app, model):
    engine_core_of("Colocated", APP)
    client = openai_client(app)
    text = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
    assert text == hf_text(model, PROMPT, 10)
    with client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, temperature=0, stream=True) as s:
        assert "".join(c.choices[0].text for c in s) == text
    assert_no_leaks(app, APP, {"colocated"})


def test_a_killed_core_is_a_5xx_then_serve_replaces_the_replica(app, model):
    kill_core_then_answers_again(app, "Colocated", APP, NAME, PROMPT, hf_text(model, PROMPT, 10))


# Last: it kills the module's replica.
def test_a_killed_replica_takes_its_core_process_with_it(app, model):
    old = _processes()
    [core] = old["engine_cores"]
    start = proc_stat(core)[19]  # so a reused pid is not taken for the core
    os.kill(old["replica"], signal.SIGKILL)
    # It must not outlive its replica: Ray ends a dead worker's children, and the core also
    # stops by itself when its pipe closes (tests/engine/test_engine_core_process.py).
    wait_for(lambda: not running(core, start), "the orphaned core process to exit", 60, 0.2)
    expected = hf_text(model, PROMPT, 10)
    wait_for(answers_exactly(openai_client(app), NAME, PROMPT, expected), "a replaced replica to answer", 180, 2.0)


def test_tensor_parallel_apps_refuse_it_before_anything_starts(model):
    from cluster.launch.app_config import AppConfig

    args = EngineArgs(model=model, engine_core_process=True)
    with pytest.raises(ParameterError, match="tensor_parallel_size=2") as e:
        AppConfig(engine_args=args, mode="pd", prefill_tensor_parallel_size=2, decode_tensor_parallel_size=2)
    assert e.value.field == "engine_core_process"
