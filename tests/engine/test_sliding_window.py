"""Sliding-window attention through the engine: a window layer's KV per request stays bounded
on a prompt many windows long (the hybrid KV cache), and the answers stay transformers' with
chunked prefill, prefix caching, preemption and tensor parallelism."""

from __future__ import annotations

from engine import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy, random_prompts

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
BLOCK = 16


def _generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _peak_blocks(llm, prompt, chunk: int) -> tuple[list[int], int, int]:
    """Run one request step by step; (its tokens, the most window-group blocks it held at once,
    the most main-group blocks)."""
    engine = llm.engine
    kv = engine.core.kv_cache_manager
    window = kv.window_group
    rid = engine.add_request(None, {"prompt_token_ids": prompt}, GREEDY)
    peak_window = peak_main = 0
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        peak_window = max(peak_window, sum(1 for b in window.req_blocks.get(rid, []) if b is not window.null))
        peak_main = max(peak_main, len(kv.req_to_blocks.get(rid, [])))
    return tokens, peak_window, peak_main


def test_window_layers_hold_a_bounded_number_of_blocks_on_a_prompt_many_windows_long(model_factory):
    model = model_factory("gemma2")  # window 16 on layer 0, full attention on layer 1
    chunk = 32
    llm = LLM(model, max_model_len=1024, max_num_batched_tokens=chunk, long_prefill_token_threshold=chunk)
    prompt = random_prompts([600], 1000, seed=11)[0]  # 37 windows
    tokens, peak_window, peak_main = _peak_blocks(llm, prompt, chunk)
    # Before a chunk at position p the window (p - 16, p] spans <= 2 blocks, the chunk <= 3.
    assert peak_window <= -(-(16 - 1) // BLOCK) + 1 + -(-chunk // BLOCK) + 1
    assert peak_main == -(-(600 + MAX_NEW - 1) // BLOCK)
    assert tokens == hf_greedy(model, [prompt], MAX_NEW)[0]
    core = llm.engine.core
    assert core.kv_cache_manager.window_group.pool.get_num_free_blocks() == \
        core.kv_cache_manager.window_group.pool.num_usable_blocks  # all returned


def test_hybrid_and_kept_blocks_give_the_same_tokens_under_preemption(model_factory):
    """Few main blocks: requests are preempted and resumed (recomputed, with prefix hits)."""
    model = model_factory("gemma3", sliding_window=11)
    prompts = random_prompts([90, 130, 70, 150], 1000, seed=2)
    expected = hf_greedy(model, prompts, MAX_NEW)
    for disable in (False, True):
        llm = LLM(model, max_model_len=256, num_kv_blocks=16, max_num_batched_tokens=48,
                  long_prefill_token_threshold=24, disable_hybrid_kv_cache_manager=disable)
        assert (llm.engine.core.kv_cache_manager.window_group is None) == disable
        assert _generate(llm, prompts) == expected
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_an_all_window_model_frees_in_its_one_group_and_matches_transformers(model_factory):
    """Mistral-style: every layer slides (sliding_window in config.json), the one group frees."""
    model = model_factory("mistral", sliding_window=24)
    llm = LLM(model, max_model_len=512, max_num_batched_tokens=32, long_prefill_token_threshold=32,
              enable_prefix_caching=True)
    kv = llm.engine.core.kv_cache_manager
    assert kv.window_group is None and kv.groups[0].window == 24
    prompts = random_prompts([200, 9, 75], 1000, seed=6)
    assert _generate(llm, prompts) == hf_greedy(model, prompts, MAX_NEW)
    second = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert second[0].num_cached_tokens >= 192  # resumed from the cached window at the end


def test_tensor_parallel_ranks_share_the_hybrid_groups(model_factory, monkeypatch):
    """TP=2 (ranks as threads): each rank holds its KV heads of both groups, and every rank
    reads the window group's table the scheduler sent."""
    from engine import executor as executor_registry
    from tests.engine.tp_threads import ThreadExecutor

    model = model_factory("gemma2", attn_logit_softcapping=3.0)
    prompts = random_prompts([3, 70, 41], 1000, seed=8)
    expected = hf_greedy(model, prompts, MAX_NEW)
    monkeypatch.setitem(executor_registry.EXECUTORS.factories, "mp", ThreadExecutor)
    two = LLM(model, tensor_parallel_size=2, max_model_len=256, long_prefill_token_threshold=16)
    try:
        assert two.engine.core.kv_cache_manager.window_group is not None
        assert _generate(two, prompts) == expected
    finally:
        two.shutdown()
