"""Which engine config each P/D role runs: decode workers speculate, prefill workers do not."""

from __future__ import annotations

from cluster.replica.host import engine_config_for_role
from engine.args import EngineArgs

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def test_prefill_workers_do_not_speculate_and_decode_workers_do():
    args = EngineArgs(model="m", speculative_config=NGRAM)
    assert engine_config_for_role(args, "prefill").speculative is None
    for role in ("decode", "colocated"):
        assert engine_config_for_role(args, role).speculative.num_speculative_tokens == 3


def test_every_role_runs_with_the_serving_token_budget_unless_one_is_given():
    from engine.config import resolved_token_budget

    for role in ("prefill", "decode", "colocated"):
        scheduler = engine_config_for_role(EngineArgs(model="m"), role).scheduler
        assert scheduler.usage_context == "serving"
        assert resolved_token_budget(scheduler, "cpu").max_num_batched_tokens == 512
        assert resolved_token_budget(scheduler, "cuda").max_num_batched_tokens == 8192
        given = engine_config_for_role(EngineArgs(model="m", max_num_batched_tokens=300), role).scheduler
        assert resolved_token_budget(given, "cpu").max_num_batched_tokens == 300


def test_a_worker_engine_steps_within_the_serving_budget(tiny_model):
    from cluster.replica.host import EngineHost

    worker = EngineHost(EngineArgs(model=tiny_model, num_kv_blocks=64, max_model_len=1024), "colocated")
    try:
        assert worker.engine.engine.core.scheduler_config.max_num_batched_tokens == 512
    finally:
        worker.engine.shutdown()
