"""Tensor parallel over every model family's shapes (ranks as threads, tests/engine/tp_threads):
TP=2 greedy tokens == Hugging Face with kv heads split (2 kv heads) and replicated (1),
chunked prefill and prefix-cache hits."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine import executor as executor_registry
from tests.engine.hf_reference import hf_greedy, random_prompts
from tests.engine.tp_threads import ThreadExecutor

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
# Prompts over 16 tokens are chunked; the second pass hits the prefix cache.
ENGINE = dict(max_model_len=256, long_prefill_token_threshold=16, max_num_batched_tokens=64)
VARIANTS = {
    "qwen2-kv1-replicated-bias-tied": ("qwen2", dict(num_key_value_heads=1)),
    "qwen3-kv2-split-qk-norm": ("qwen3", {}),
    "mistral-kv1-replicated": ("mistral", dict(num_key_value_heads=1)),
    # MoE: every rank holds every expert's slice of the intermediate dim, router replicated.
    "mixtral-experts-split": ("mixtral", {}),
    "qwen3_moe-experts-split-dense-layer": ("qwen3_moe", dict(norm_topk_prob=False, mlp_only_layers=[1])),
}


def _generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], sum(o.num_cached_tokens for o in outs)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tp2_greedy_equals_transformers(model_factory, monkeypatch, variant):
    """(TP=1 == transformers for these shapes: test_parity.py.)"""
    family, overrides = VARIANTS[variant]
    model = model_factory(family, **overrides)
    prompts = random_prompts([3, 21, 40], 900, seed=7)
    expected = hf_greedy(model, prompts, GREEDY.max_tokens)
    monkeypatch.setitem(executor_registry.EXECUTORS.factories, "mp", ThreadExecutor)
    two = LLM(model, tensor_parallel_size=2, **ENGINE)
    assert isinstance(two.engine.core.executor, ThreadExecutor)
    try:
        assert _generate(two, prompts)[0] == expected
        again, cached = _generate(two, prompts)
        assert again == expected and cached > 0
    finally:
        two.shutdown()
