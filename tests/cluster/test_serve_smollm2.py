"""The default real model over HTTP: SmolLM2-135M-Instruct (GGUF) under its served name,
answering a chat question with a known fact, and a `response_format` JSON schema with JSON that
validates. Colocated, the cheaper mode on two cores (P/D
with the same engine is covered with the tiny models in test_serve_pd)."""

from __future__ import annotations

import pytest

from tests.cluster.helpers import ENGINE, assert_no_leaks
from tests.engine.so_oracles import COUNTRY_SCHEMA, FRANCE_QUESTION, assert_valid_json

APP = "smoltest"
NAME = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def app(deploy, smollm2):
    from cluster.launch.app_config import AppConfig
    from cluster.launch.serve_cli import warm_tokenizer_cache
    from engine import EngineArgs

    warm_tokenizer_cache(smollm2)  # as `pdserve serve` does: replicas then skip the conversion
    # No served_model_name: the default model is served under its own name.
    cfg = AppConfig(engine_args=EngineArgs(model=smollm2, **ENGINE), mode="colocated", app_name=APP,
                    replica_num_cpus=0)
    return deploy(cfg)


def test_chat_over_http_answers_the_capital_of_france(app):
    from openai import OpenAI

    client = OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [NAME]
    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    assert "Paris" in r.choices[0].message.content, r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"  # the model ended its answer (EOS), not the limit
    assert_no_leaks(app, APP, {"colocated"})


def test_chat_response_format_json_schema_validates(app):
    from openai import OpenAI

    client = OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0)
    rf = {"type": "json_schema", "json_schema": {"name": "country", "schema": COUNTRY_SCHEMA, "strict": True}}
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": FRANCE_QUESTION}],
                                       max_tokens=64, temperature=0, response_format=rf)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    assert_valid_json(text, COUNTRY_SCHEMA)
    assert_no_leaks(app, APP, {"colocated"})
