"""POST /v1/embeddings on a pooling model served in P/D mode: every prompt is sent to a
Prefill replica, which answers it whole (an embedding needs only the prefill; no KV moves).
Oracles: transformers' last hidden states pooled as the engine pools them, through the
official openai client (base64, its default, and float); OpenAI's error shape for bad input."""

from __future__ import annotations

import pytest
import requests

from tests.cluster.helpers import assert_no_leaks, metric_value, openai_client, tiny_app, wait_for
from tests.engine.hf_reference import random_prompts
from tests.engine.pooling_factory import cosine, hf_pooled

APP = "embedtest"
NAME = "tiny-embed"


@pytest.fixture(scope="module")
def qwen3(model_factory) -> str:
    return model_factory("qwen3")


@pytest.fixture(scope="module")
def app(deploy, qwen3):
    return deploy(tiny_app(qwen3, "pd", NAME, APP, engine={"runner": "pooling", "engine_core_process": True}))


def test_embeddings_match_transformers_through_the_openai_client(app, qwen3):
    client = openai_client(app)
    prompts = random_prompts([1, 9, 300], 1000, seed=41)
    got = client.embeddings.create(model=NAME, input=prompts)  # base64 on the wire, decoded by the client
    assert [d.index for d in got.data] == [0, 1, 2] and got.data[0].object == "embedding"
    assert got.usage.prompt_tokens == got.usage.total_tokens == 310 and got.model == NAME
    for p, d in zip(prompts, got.data):
        assert cosine(d.embedding, hf_pooled(qwen3, p, "LAST")) >= 0.9999
    text = "The river ran quietly past the mill"
    ids = client.embeddings.create(model=NAME, input=text, encoding_format="float")
    assert isinstance(ids.data[0].embedding, list) and len(ids.data[0].embedding) == 64
    tokens = _token_ids(qwen3, text)
    assert cosine(ids.data[0].embedding, hf_pooled(qwen3, tokens, "LAST")) >= 0.9999
    # Prefill only, on the Prefill replica: the decode engine computed nothing.
    step_tokens = "pdserve:engine_step_tokens_total"
    wait_for(lambda: metric_value(app, step_tokens, role="prefill") >= 310 + len(tokens), "the prefill's figures")
    assert metric_value(app, step_tokens, role="decode") == 0
    assert_no_leaks(app, APP, {"prefill", "decode"})


def _token_ids(model_dir: str, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": "hello", "dimensions": 8}, "dimensions"),
    ({"input": "hello", "encoding_format": "int8"}, "encoding_format"),
    ({"input": [[5] * 513]}, "input"),  # past max_model_len (512)
])
def test_bad_embedding_input_is_a_400_naming_the_field(app, body, param):
    r = requests.post(f"{app}/v1/embeddings", json={"model": NAME, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_rerank_on_an_embedding_model_orders_by_cosine_similarity(app, qwen3):
    query, docs = "where does the river run", ["The river ran past the mill", "A cat slept", "The sea"]
    r = requests.post(f"{app}/v1/rerank", json={"model": NAME, "query": query, "documents": docs}, timeout=60)
    assert r.status_code == 200, r.text
    q = hf_pooled(qwen3, _token_ids(qwen3, query), "LAST")
    expected = [cosine(q, hf_pooled(qwen3, _token_ids(qwen3, d), "LAST")) for d in docs]
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(3), key=lambda i: -expected[i])
    assert [x["relevance_score"] for x in results] == pytest.approx(sorted(expected, reverse=True), abs=1e-4)


def test_other_routes_on_a_pooling_model_are_400_and_unknown_models_404(app):
    r = requests.post(f"{app}/v1/chat/completions", timeout=60,
                      json={"model": NAME, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "pooling model" in r.json()["error"]["message"]
    r = requests.post(f"{app}/v1/embeddings", json={"model": "nope", "input": "hi"}, timeout=60)
    assert r.status_code == 404
