"""The shared KV tier in a Serve app (--kv-shared-tier-size): two colocated engine replicas
share the app's KV store; a prompt one of them computed is loaded by the other (the
directory counts the hit), answers equal Hugging Face's, and nothing leaks."""

from __future__ import annotations

import pytest

from engine import EngineArgs
from tests.cluster.helpers import (
    ENGINE,
    assert_no_leaks,
    hf_text,
    openai_client,
    replicas,
    wait_for,
)


def tokenizer_ids(model: str, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)(text)["input_ids"]

APP = "sharedtier"
NAME = "tiny-shared"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def app(deploy, tiny_model):
    from cluster.launch.app_config import AppConfig

    # KV events on: each replica's report counts the blocks its mirror of the directory holds.
    cfg = AppConfig(engine_args=EngineArgs(model=tiny_model, block_size=16, kv_shared_tier_size=0.01,
                                           kv_events_config={"enable_kv_cache_events": True}, **ENGINE),
                    mode="colocated", served_model_name=NAME, app_name=APP, colocated_replicas=2,
                    replica_num_cpus=0, router_mode="round-robin")
    assert not cfg.direct  # the tier needs the engines in replicas of their own
    return deploy(cfg)


def _shared_stats(ray) -> dict:
    from kvstore.store_actor import find_app_store

    return ray.get(find_app_store(APP).shared_stats.remote(), timeout=30)


def test_a_prompt_one_replica_computed_is_loaded_by_the_other(app, tiny_model, ray_local):
    prompt = " ".join(f"word{i}" for i in range(60))  # well over a few 16-token blocks
    expected = hf_text(tiny_model, prompt, MAX_TOKENS)
    client = openai_client(app)
    # Round robin: the second ask goes to the replica that did not compute the prompt. It is
    # sent once both replicas' mirrors of the directory hold the prompt's blocks.
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert first.choices[0].text == expected
    blocks = len(tokenizer_ids(tiny_model, prompt)) // 16
    wait_for(lambda: [r["kv_cached_blocks"].get("shared", 0) >= blocks for r in replicas(app)] == [True, True],
             "both replicas' mirrors to hold the prompt's blocks", 60)
    second = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert second.choices[0].text == expected
    stats = _shared_stats(ray_local)
    assert stats["blocks"] > 0 and stats["hits"] > 0, stats
    assert_no_leaks(app, APP, {"colocated"})
