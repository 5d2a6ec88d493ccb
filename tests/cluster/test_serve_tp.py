"""The Serve app in P/D mode with tensor-parallel roles (two rank actors per replica, placed by
the replica's own placement group), driven by the official openai client.

Oracles: Hugging Face greedy text; the KV transfer counters (one export and one load per rank
per request: each rank moves its own heads); the replicas' KV figures (no leak). The last test
kills a decode rank: the request in its way gets a 5xx, never a hang or a wrong 200, and Serve
replaces the replica with its ranks, after which answers equal Hugging Face again.
"""

from __future__ import annotations

import openai
import pytest

from tests.cluster.helpers import ENGINE, assert_no_leaks, metric_value, wait_for
from tests.engine.hf_reference import hf_greedy

APP = "tptest"
NAME = "tiny-tp"
PROMPTS = ["The river ran quietly past", "A good engineer measures before",
           "Once upon a time there was a small village by the sea where"]
TP = 2


@pytest.fixture(scope="module")
def app(deploy, tiny_model):
    from cluster.launch.app_config import AppConfig
    from engine import EngineArgs

    cfg = AppConfig(engine_args=EngineArgs(model=tiny_model, tensor_parallel_size=TP, **ENGINE),
                    mode="pd", served_model_name=NAME, app_name=APP, replica_num_cpus=0,
                    health_check_period_s=1.0)  # the kill test waits on three failed checks
    return deploy(cfg)


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def _hf_texts(tiny_model, tokenizer, prompts: list[str], max_tokens: int) -> list[str]:
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    return [tokenizer.decode(o, skip_special_tokens=True) for o in hf_greedy(tiny_model, ids, max_tokens)]


def _ranks(role: str) -> list:
    from ray import serve

    return serve.get_deployment_handle(role, APP).tensor_parallel_ranks.remote().result(timeout_s=30)


def test_tp2_roles_answer_like_transformers_and_move_kv_per_rank(app, client, tiny_model, tokenizer):
    assert len(_ranks("Prefill")) == len(_ranks("Decode")) == TP
    exports0, loads0 = (metric_value(app, "pdserve:kv_transfer_exports_total"),
                        metric_value(app, "pdserve:kv_transfer_loads_total"))
    texts = [client.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0).choices[0].text
             for p in PROMPTS]
    stream = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True)
    streamed = "".join(c.choices[0].text for c in stream)
    assert texts == _hf_texts(tiny_model, tokenizer, PROMPTS, 12)
    assert streamed == texts[0]
    moved = TP * (len(PROMPTS) + 1)
    # Replica figures reach /metrics with the routing-stats rounds: wait (bounded) for them.
    wait_for(lambda: metric_value(app, "pdserve:kv_transfer_exports_total") - exports0 == moved
             and metric_value(app, "pdserve:kv_transfer_loads_total") - loads0 == moved,
             f"{moved} KV exports and loads (one per rank per request)", 30)
    assert_no_leaks(app, APP, {"prefill", "decode"})


# Last: it kills a rank of the module's decode replica.
def test_a_killed_decode_rank_is_a_5xx_then_serve_replaces_the_replica(app, client, tiny_model, tokenizer):
    import ray

    ray.kill(_ranks("Decode")[1])
    with pytest.raises(openai.APIStatusError) as failed:
        client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0)
    assert failed.value.status_code >= 500
    # Serve's health check fails the replica and starts a new one with new ranks.
    expected = _hf_texts(tiny_model, tokenizer, PROMPTS[1:2], 12)[0]

    errors: list[str] = []

    def answers_again() -> bool:
        try:
            r = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0)
        except openai.APIStatusError as e:
            assert e.status_code >= 500  # never a 4xx for a good request
            errors.append(f"{e.status_code}: {e.message}")
            return False
        assert r.choices[0].text == expected  # never a wrong 200
        return True

    try:
        wait_for(answers_again, "a replaced decode replica to answer", 180, interval_s=2.0)
    except AssertionError as e:
        from ray import serve

        # What a failure here needs to be understood: the replies and what Serve thinks.
        raise AssertionError(f"{e}; errors: {errors[:2]} ... {errors[-2:]}; "
                             f"status: {serve.status().applications.get(APP)}") from None
    assert len(_ranks("Decode")) == TP
