"""LoRA over HTTP with the official openai client, colocated and P/D: a request's `model` picks
its adapter (or the base model), requests of two adapters and the base run concurrently, and
the text equals PEFT's greedy continuation; /v1/models lists adapters with their parent; an
adapter loaded at run time answers like one served from the start; unknown names are 404s.
"""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
import requests

from tests.cluster.helpers import SHARED_NAME, assert_no_leaks, openai_client
from tests.engine.hf_reference import random_prompts
from tests.engine.lora_factory import peft_greedy

NAME = SHARED_NAME
N = 12


@pytest.fixture(scope="module")
def adapters(lora_adapters) -> dict[str, str]:
    return lora_adapters


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


PROMPTS = random_prompts([7, 19, 12, 26, 9, 15], 1000, seed=51)


def _expected(tiny_model, tokenizer, adapter_dir, prompt):
    return tokenizer.decode(peft_greedy(tiny_model, adapter_dir, [prompt], N)[0], skip_special_tokens=True)


def _complete(client, model, prompt):
    r = client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0)
    assert r.model == model
    return r.choices[0].text


def _models(app) -> dict[str, dict]:
    """/v1/models by id (the ids unique). Other modules share the app and may load adapters of
    their own: a test checks the entries it knows of, not the whole list."""
    data = requests.get(f"{app}/v1/models", timeout=30).json()["data"]
    models = {m["id"]: m for m in data}
    assert len(models) == len(data), data
    assert data[0]["id"] == NAME  # the base model first, as vLLM lists it
    return models


def _adapter_entry(models, name, path):
    m = models[name]
    assert (m["object"], m["parent"], m["root"], m["max_model_len"]) == ("model", NAME, path, 1024), m


def test_models_list_the_adapters_with_their_parent(app, adapters, tiny_model):
    models = _models(app)
    base = models[NAME]
    assert (base["object"], base["parent"], base["root"], base["max_model_len"]) == ("model", None, tiny_model, 1024)
    _adapter_entry(models, "a1", adapters["a1"])  # served from the start
    assert all(m["parent"] == NAME for i, m in models.items() if i != NAME)
    metrics = requests.get(f"{app}/metrics", timeout=30).text
    info = [line for line in metrics.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert info and all('max_lora="2"' in line for line in info), metrics[-2000:]


def test_concurrent_requests_of_an_adapter_loaded_at_run_time_one_served_from_the_start_and_the_base_match_peft(
        app, adapters, tiny_model, tokenizer, mode, shared_app):
    r = requests.post(f"{app}/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": adapters["a2"]}, timeout=60)
    assert r.status_code == 200, r.text
    _adapter_entry(_models(app), "a2", adapters["a2"])
    client = openai_client(app)
    models = ["a1", "a2", NAME, "a2", "a1", NAME]
    dirs = {"a1": adapters["a1"], "a2": adapters["a2"], NAME: None}
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda mp: _complete(client, *mp), zip(models, PROMPTS)))
    assert got == [_expected(tiny_model, tokenizer, dirs[m], p) for m, p in zip(models, PROMPTS)]
    # Chat goes through the same adapter.
    chat = client.chat.completions.create(model="a2", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.model == "a2" and chat.choices[0].finish_reason in ("length", "stop")
    assert_no_leaks(app, shared_app.name, shared_app.roles)
    r = requests.post(f"{app}/v1/unload_lora_adapter", json={"lora_name": "a2"}, timeout=60)
    assert r.status_code == 200, r.text
    assert "a2" not in _models(app)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a2", prompt=PROMPTS[0], max_tokens=2)


def test_unknown_models_and_bad_adapters_are_refused_by_field(app, adapters):
    client = openai_client(app)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    assert "no-such-adapter" in str(e.value)
    r = requests.post(f"{app}/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": adapters["big"]},
                      timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_lora_rank", r.text
    r = requests.post(f"{app}/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": adapters["a1"]},
                      timeout=60)
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = requests.post(f"{app}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/dir"},
                      timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = requests.post(f"{app}/v1/unload_lora_adapter", json={"lora_name": "never-loaded"}, timeout=60)
    assert r.status_code == 404
