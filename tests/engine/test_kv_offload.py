"""The host KV tier (engine.kv_offload) in a whole engine: prefixes the engine's own pool
evicted are loaded from host memory instead of recomputed, with greedy outputs equal to
Hugging Face's; a corrupt host block is refused and recomputed; the tier keeps to its size;
nothing leaks; its KV events mirror what it holds."""

from __future__ import annotations

import dataclasses

import pytest

from engine import LLM, EngineArgs, SamplingParams
from engine.kv_cache.events import HOST, BlockStored
from engine.kv_cache.prefix_index import PrefixIndex, key
from engine.kv_offload.factory import block_bytes
from engine.llm_engine import LLMEngine
from tests.engine.hf_reference import hf_greedy, random_prompts

BS = 8
NUM_BLOCKS = 40  # 320 tokens: one round of the prompts below does not stay in the pool
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
ENGINE = dict(max_model_len=256, block_size=BS, num_kv_blocks=NUM_BLOCKS)
TIER_GB = 0.01


def _prompts():
    return random_prompts([100, 90, 120, 80], 1000, seed=31)


def _round(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def _tier(llm):
    """The host tier's worker side (the in-process executor's one worker)."""
    return llm.engine.core.executor.worker.kv_connector


def _computed_tokens(llm, prompts):
    """(tokens, cached tokens per prompt, tokens the engine computed for the round)."""
    before = llm.engine.core.num_scheduled_tokens
    tokens, cached = _round(llm, prompts)
    return tokens, cached, llm.engine.core.num_scheduled_tokens - before


def _assert_no_leaks(llm):
    core = llm.engine.core
    assert core.num_free_blocks() == core.num_kv_blocks
    assert not core.has_unfinished_requests()


def test_second_round_loads_evicted_prefixes_from_host_with_outputs_equal_to_transformers(tiny_model):
    prompts = _prompts()
    expected = hf_greedy(tiny_model, prompts, MAX_NEW)
    plain = LLM(tiny_model, **ENGINE)
    tier = LLM(tiny_model, kv_offloading_size=TIER_GB, **ENGINE)
    plain_runs = [_computed_tokens(plain, prompts) for _ in range(2)]
    tier_runs = [_computed_tokens(tier, prompts) for _ in range(2)]
    for tokens, _, _ in plain_runs + tier_runs:
        assert tokens == expected
    (_, _, plain_first), (_, plain_cached, plain_second) = plain_runs
    (_, _, tier_first), (_, tier_cached, tier_second) = tier_runs
    # The pool alone keeps little of round 1; with the tier every prompt hits all its full
    # blocks but the one holding its last token.
    assert sum(plain_cached) <= BS * 4
    assert tier_cached == [(len(p) - 1) // BS * BS for p in prompts]
    assert tier_second < plain_second - sum(tier_cached) // 2
    assert plain_second >= plain_first * 0.9
    stats, load = tier.engine.core.kv_transfer_stats(), tier.engine.core.load()
    # Hits past what the pool kept came from the host (most of them), every one loaded.
    assert load.external_prefix_cache_hits + load.prefix_cache_hits >= sum(tier_cached)
    assert load.external_prefix_cache_hits >= sum(tier_cached) // 2
    assert stats["host_hit_tokens"] >= load.external_prefix_cache_hits and stats["host_refused"] == 0
    assert load.external_prefix_cache_queries == 2 * sum(len(p) for p in prompts)
    metrics = {m.name: m.value for m in tier.get_metrics() if m.name.startswith("vllm:external_prefix_cache")}
    assert metrics == {"vllm:external_prefix_cache_queries": load.external_prefix_cache_queries,
                       "vllm:external_prefix_cache_hits": load.external_prefix_cache_hits}
    _assert_no_leaks(plain)
    _assert_no_leaks(tier)


def test_a_corrupt_host_block_is_refused_and_recomputed(tiny_model):
    prompts = _prompts()
    llm = LLM(tiny_model, kv_offloading_size=TIER_GB, **ENGINE)
    first, _ = _round(llm, prompts)
    pool = _tier(llm).pool
    for block in pool._blocks.values():
        block.data.view(-1)[0] += 1.0  # one value of every block: the crc32 no longer matches
    before = llm.engine.core.kv_transfer_stats()
    second, cached = _round(llm, prompts)
    assert second == first == hf_greedy(tiny_model, prompts, MAX_NEW)
    stats = llm.engine.core.kv_transfer_stats()
    assert stats["host_refused"] > before["host_refused"] and stats["host_loads"] == before["host_loads"]
    _assert_no_leaks(llm)
    # The refused blocks were dropped and stored again from the recompute: a third round
    # loads them.
    third, cached = _round(llm, prompts)
    assert third == first and llm.engine.core.kv_transfer_stats()["host_loads"] > stats["host_loads"]


def test_the_tier_keeps_within_its_size_least_recently_used_first_out(tiny_model):
    llm = LLM(tiny_model, **ENGINE)
    per_block = block_bytes(llm.engine.core.arch, llm.engine.core.dtype, BS)
    size_blocks = 12
    llm = LLM(tiny_model, kv_offloading_size=size_blocks * per_block / 2**30, **ENGINE)
    prompts = random_prompts([60, 70, 80, 90, 100], 1000, seed=32)
    for p in prompts:
        _round(llm, [p])
        stats = llm.engine.core.kv_transfer_stats()
        assert stats["host_bytes_held"] <= size_blocks * per_block
        assert stats["host_blocks_held"] <= size_blocks
    assert stats["host_evictions"] > 0 and stats["host_self_evictions"] == 0
    # The last prompt's blocks are the newest: they are what the tier still holds.
    _, cached = _round(llm, prompts[-1:])
    assert cached[0] > 0
    _assert_no_leaks(llm)


def test_an_engine_core_process_gets_its_tier_too(tiny_model):
    prompts = _prompts()
    llm = LLM(tiny_model, kv_offloading_size=TIER_GB, engine_core_process=True, **ENGINE)
    try:
        first, _ = _round(llm, prompts)
        second, cached = _round(llm, prompts)
        assert second == first and cached == [(len(p) - 1) // BS * BS for p in prompts]
    finally:
        llm.shutdown()


def test_prompt_logprobs_requests_compute_their_whole_prompt(tiny_model):
    llm = LLM(tiny_model, kv_offloading_size=TIER_GB, **ENGINE)
    prompts = _prompts()
    _round(llm, prompts)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in outs)
    _assert_no_leaks(llm)


def _events_engine(model):
    config = EngineArgs.from_kwargs(model, kv_offloading_size=TIER_GB, **ENGINE).create_engine_config()
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, enable_kv_cache_events=True))
    return LLMEngine(config)


def test_host_events_feed_a_prefix_index_that_mirrors_what_the_tier_holds(tiny_model):
    engine = _events_engine(tiny_model)
    index = PrefixIndex()
    host_stored = []
    for i, prompt in enumerate(_prompts() * 2):
        rid = engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, GREEDY)
        done = False
        while not done:
            done = any(o.request_id == rid and o.finished for o in engine.step())
            batch = engine.core.last_kv_events
            if batch is not None:
                assert index.apply("engine", batch)
                host_stored += [e for e in batch.events if isinstance(e, BlockStored) and e.medium == HOST]
    held = engine.core.connector.kv_held()[HOST]
    assert held and host_stored
    assert set(index.held("engine", HOST)) == {key(h) for h in held}
    assert set(index.held("engine", "device")) == {key(h) for h in engine.core.kv_cache_manager.cached_hashes()}
    # A stored run names its parent: the block before its first in the prompt.
    run = host_stored[0]
    assert run.num_tokens == len(run.block_hashes) * BS and run.parent_block_hash is None


@pytest.mark.parametrize(("kwargs", "field", "words"), [
    (dict(kv_offloading_size=0), "kv_offloading_size", "> 0"),
    (dict(kv_offloading_size=-1.0), "kv_offloading_size", "> 0"),
    (dict(kv_offloading_size=0.5, kv_offloading_backend="lmcache"), "kv_offloading_backend", "('native',)"),
    (dict(kv_offloading_backend="lmcache"), "kv_offloading_backend", "('native',)"),
    (dict(kv_offloading_size=0.5, enable_prefix_caching=False), "kv_offloading_size", "enable_prefix_caching"),
    (dict(kv_offloading_size=0.5, tensor_parallel_size=2), "kv_offloading_size", "tensor_parallel_size=1"),
])
def test_bad_offloading_arguments_name_the_field_and_what_is_allowed(kwargs, field, words):
    from engine.errors import ParameterError

    with pytest.raises(ParameterError) as e:
        EngineArgs.from_kwargs("some-model", **kwargs).create_engine_config()
    assert e.value.field == field and words in str(e.value)


def test_a_tier_smaller_than_one_block_is_refused(tiny_model):
    from engine.errors import ParameterError

    with pytest.raises(ParameterError, match="holds no KV block") as e:
        LLM(tiny_model, kv_offloading_size=1e-9, **ENGINE)
    assert e.value.field == "kv_offloading_size"


def test_offloading_flags_parse_under_vllms_names():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--kv-offloading-size", "0.5",
                                                       "--kv-offloading-backend", "native"]))
    assert args.kv_offloading_size == 0.5 and args.kv_offloading_backend == "native"
    assert EngineArgs.from_kwargs("m").kv_offloading_size is None
