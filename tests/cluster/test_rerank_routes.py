"""/v1/score, /rerank and /v1/rerank on a cross-encoder: the ingress's real app (uvicorn, no
Serve: tests/cluster/ingress_harness.py) over a real in-process engine of the model, colocated.
Each (query, document) pair is one pooling request; scores against transformers' classifier
within 1e-4, results ordered by relevance with their index, OpenAI's error shape for bad input,
and every KV block free afterwards."""

from __future__ import annotations

import pytest
import requests

from tests.cluster.ingress_harness import make_ingress, serve_ingress
from tests.engine.pooling_factory import hf_classifier_scores, make_classifier

NAME = "tiny-rerank"
QUERY = "where does the river run"
DOCS = ["The river ran quietly past the mill.", "A cat slept.", "Mountains rise over the plain.",
        "The water runs down to the sea."]


@pytest.fixture(scope="module")
def cross_encoder(model_factory, tmp_path_factory) -> str:
    return make_classifier(model_factory("llama"), str(tmp_path_factory.mktemp("cross-encoder")))


@pytest.fixture(scope="module")
def engine(cross_encoder):
    from engine import AsyncLLM, EngineArgs

    llm = AsyncLLM.from_engine_args(EngineArgs(cross_encoder, max_model_len=256, num_kv_blocks=64))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def app(cross_encoder, engine):
    served = serve_ingress(make_ingress(cross_encoder, name=NAME, engines=engine))
    yield served.url
    served.stop()


def _expected(model_dir: str) -> list[float]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [hf_classifier_scores(model_dir, tok(QUERY, d)["input_ids"]).item() for d in DOCS]


@pytest.mark.parametrize("route", ["/rerank", "/v1/rerank"])
def test_rerank_orders_the_documents_by_transformers_scores(app, cross_encoder, route):
    expected = _expected(cross_encoder)
    r = requests.post(f"{app}{route}", json={"model": NAME, "query": QUERY, "documents": DOCS, "top_n": 3},
                      timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])[:3]
    assert [x["index"] for x in results] == order
    for x in results:
        assert x["relevance_score"] == pytest.approx(expected[x["index"]], abs=1e-4)
        assert x["document"]["text"] == DOCS[x["index"]]
    bare = requests.post(f"{app}{route}", json={"model": NAME, "query": QUERY, "documents": DOCS,
                                                "return_documents": False}, timeout=60).json()
    assert len(bare["results"]) == 4 and all(x.get("document") is None for x in bare["results"])


def test_score_answers_each_pair_in_order(app, cross_encoder, engine):
    expected = _expected(cross_encoder)
    r = requests.post(f"{app}/v1/score", json={"model": NAME, "text_1": QUERY, "text_2": DOCS}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and body["data"][0]["object"] == "score"
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-4)
    assert body["usage"]["prompt_tokens"] > 0
    core = engine.engine.core
    assert not core.has_unfinished_requests() and core.num_free_blocks() == core.num_kv_blocks


@pytest.mark.parametrize("route,body,param", [
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
    ("/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, "text_2"),
    ("/v1/embeddings", {"input": "hello"}, "model"),  # a classifier does not embed
])
def test_bad_score_requests_are_a_400_naming_the_field(app, route, body, param):
    r = requests.post(f"{app}{route}", json={"model": NAME, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
