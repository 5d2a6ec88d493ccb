"""The Serve app with a data-parallel group as its replica: a colocated replica whose engine
is two core actors with the experts split over them (expert parallel, lockstep waves), placed
in the replica's own placement group; driven by the official openai client.

Oracles: Hugging Face greedy text; the per-core figures on /metrics (both cores took requests,
the idle one stepped on no tokens); the replica's KV figures (no leak)."""

from __future__ import annotations

import openai
import pytest

from tests.cluster.helpers import ENGINE, assert_no_leaks, metric_value, wait_for
from tests.engine.hf_reference import hf_greedy

APP = "dptest"
NAME = "moe-dp"
PROMPTS = ["The river ran quietly past", "A good engineer measures before",
           "Once upon a time there was a small village by the sea where", "Numbers and letters"]


@pytest.fixture(scope="module")
def moe_model(model_factory) -> str:
    return model_factory("qwen3_moe")


@pytest.fixture(scope="module")
def app(deploy, moe_model):
    from cluster.launch.app_config import AppConfig
    from engine import EngineArgs

    cfg = AppConfig(engine_args=EngineArgs(model=moe_model, data_parallel_size=2, enable_expert_parallel=True,
                                           **ENGINE),
                    mode="colocated", served_model_name=NAME, app_name=APP, replica_num_cpus=0,
                    health_check_period_s=1.0)  # the kill test waits on three failed checks
    return deploy(cfg)


def _hf_texts(model: str, prompts: list[str], max_tokens: int) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    return [tokenizer.decode(o, skip_special_tokens=True) for o in hf_greedy(model, ids, max_tokens)]


def test_a_data_parallel_replica_answers_like_transformers_over_both_cores(app, moe_model):
    import ray
    from ray import serve

    replica = serve.get_deployment_handle("Colocated", APP)
    cores = replica.data_parallel_cores.remote().result(timeout_s=30)
    assert len(cores) == 2
    # One placement group for the replica and its cores: Serve reserves and replaces them together.
    group = replica.placement_group_id.remote().result(timeout_s=30)
    assert group is not None and ray.get([c.placement_group_id.remote() for c in cores]) == [group, group]

    client = openai.OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0, timeout=120)
    texts = [client.completions.create(model=NAME, prompt=p, max_tokens=10, temperature=0).choices[0].text
             for p in PROMPTS]
    assert texts == _hf_texts(moe_model, PROMPTS, 10)

    def served(engine: str) -> float:
        return metric_value(app, "pdserve:dp_engine_requests_total", engine=engine)

    # Replica figures reach /metrics with the routing-stats rounds: wait (bounded) for them.
    wait_for(lambda: served("0") + served("1") == len(PROMPTS), "every request counted on a core", 30)
    assert served("0") >= 1 and served("1") >= 1
    assert metric_value(app, "pdserve:dp_dummy_batches_total", engine="0") \
        + metric_value(app, "pdserve:dp_dummy_batches_total", engine="1") > 0
    assert_no_leaks(app, APP, {"colocated"})


# Last: it kills a core of the module's replica.
def test_a_killed_core_is_a_5xx_then_serve_replaces_the_whole_group(app, moe_model):
    import ray
    from ray import serve

    replica = serve.get_deployment_handle("Colocated", APP)
    old = replica.data_parallel_cores.remote().result(timeout_s=30)
    ray.kill(old[1])
    client = openai.OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.APIStatusError) as failed:
        client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=10, temperature=0)
    assert failed.value.status_code >= 500
    with pytest.raises(ray.exceptions.RayActorError):  # the survivor went with the group
        ray.get(old[0].ping.remote(), timeout=60)
    expected = _hf_texts(moe_model, PROMPTS[1:2], 10)[0]

    def answers_again() -> bool:
        try:
            r = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=10, temperature=0)
        except openai.APIStatusError as e:
            assert e.status_code >= 500  # never a 4xx for a good request
            return False
        assert r.choices[0].text == expected  # never a wrong 200
        return True

    wait_for(answers_again, "a replaced data-parallel replica to answer", 180, interval_s=2.0)
    assert len(replica.data_parallel_cores.remote().result(timeout_s=30)) == 2
