"""The per-step token budget's defaults: by device and usage context (vLLM's habit: the API
server and the offline LLM class default differently), and an explicit value always wins."""

from __future__ import annotations

import pytest

from engine import LLM, AsyncLLM
from engine.args import EngineArgs
from engine.config import SchedulerConfig, resolved_token_budget
from engine.errors import ParameterError


@pytest.mark.parametrize("context, cpu", [("offline", 2048), ("serving", 512)])
def test_default_budget_by_device_and_usage_context(context, cpu):
    config = SchedulerConfig(usage_context=context)
    assert resolved_token_budget(config, "cpu").max_num_batched_tokens == cpu
    assert resolved_token_budget(config, "cuda").max_num_batched_tokens == 8192
    explicit = SchedulerConfig(max_num_batched_tokens=96, usage_context=context)
    assert resolved_token_budget(explicit, "cpu").max_num_batched_tokens == 96
    assert resolved_token_budget(explicit, "cuda").max_num_batched_tokens == 96


def test_engine_args_are_offline_unless_told_otherwise():
    assert EngineArgs(model="m").create_engine_config().scheduler.usage_context == "offline"
    serving = EngineArgs(model="m").create_engine_config(usage_context="serving")
    assert serving.scheduler.usage_context == "serving"


def test_unknown_usage_context_names_the_field_and_the_choices():
    with pytest.raises(ParameterError, match=r"usage_context must be one of \('offline', 'serving'\)"):
        EngineArgs(model="m").create_engine_config(usage_context="online")


def test_the_llm_class_keeps_the_offline_budget(tiny_model):
    llm = LLM(tiny_model, num_kv_blocks=64, max_model_len=1024)
    assert llm.engine.core.scheduler_config.max_num_batched_tokens == 2048


def test_async_llm_from_engine_args_takes_the_serving_budget(tiny_model):
    engine = AsyncLLM.from_engine_args(EngineArgs(tiny_model, num_kv_blocks=64, max_model_len=1024))
    try:
        assert engine.engine.core.scheduler_config.max_num_batched_tokens == 512
    finally:
        engine.shutdown()
