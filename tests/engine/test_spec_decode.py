"""Speculative decoding end to end: greedy outputs equal non-speculative decoding and
Hugging Face `generate` token for token (drafts actually accepted), under chunked prefill,
prefix-cache hits and preemption; stops inside an accepted run cut exactly where
non-speculative decoding stops."""

from __future__ import annotations

import functools

import pytest

from engine import LLM, SamplingParams
from engine.metrics import Counter
from tests.engine.hf_reference import hf_greedy, random_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def _prompts() -> list[list[int]]:
    """Repetitive prompts (the random model then repeats itself too, so drafts get accepted)
    next to plain random ones."""
    base = random_prompts([12, 7], 1000, seed=5)
    return [base[0] * 4, base[1] * 6 + [11, 12], *random_prompts([9, 40], 1000, seed=6)]


@functools.lru_cache(maxsize=4)
def _hf(model: str, prompts: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    return hf_greedy(model, [list(p) for p in prompts], MAX_NEW)


def _hf_greedy(model: str, prompts: list[list[int]]) -> list[list[int]]:
    """The transformers oracle, computed once per prompt set."""
    return _hf(model, tuple(tuple(p) for p in prompts))


def _generate(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _counter(llm, name: str) -> int:
    return sum(m.value for m in llm.get_metrics() if m.name == name and isinstance(m, Counter))


@pytest.mark.parametrize("engine_kwargs", [
    {},
    {"long_prefill_token_threshold": 7, "max_num_batched_tokens": 24},
    {"max_num_batched_tokens": 3, "max_num_seqs": 2},  # the budget cuts drafts short
], ids=["plain", "chunked-prefill", "tight-budget"])
def test_greedy_with_ngram_speculation_matches_transformers(tiny_model, engine_kwargs):
    prompts = _prompts()
    llm = LLM(tiny_model, max_model_len=256, speculative_config=NGRAM, **engine_kwargs)
    assert _generate(llm, prompts) == _hf_greedy(tiny_model, prompts)
    assert _counter(llm, "vllm:spec_decode_num_accepted_tokens") > 0
    assert _counter(llm, "vllm:spec_decode_num_draft_tokens") >= _counter(llm, "vllm:spec_decode_num_accepted_tokens")


def test_greedy_with_speculation_under_preemption_frees_every_block(tiny_model):
    llm = LLM(tiny_model, max_model_len=128, block_size=8, num_kv_blocks=16, enable_prefix_caching=False,
              speculative_config=NGRAM)
    prompts = _prompts() + random_prompts([33, 17], 1000, seed=7)
    got = _generate(llm, prompts)
    assert _counter(llm, "vllm:num_preemptions") > 0, "the KV pool was meant to force preemption"
    assert _counter(llm, "vllm:spec_decode_num_accepted_tokens") > 0
    assert got == _hf_greedy(tiny_model, prompts)
    assert llm.engine.core.kv_cache_manager.get_num_free_blocks() == 16


def test_prefix_cache_holds_only_verified_tokens(tiny_model):
    llm = LLM(tiny_model, max_model_len=256, block_size=4, speculative_config=NGRAM)
    prompts = _prompts()
    first = _generate(llm, prompts)
    # Continuing from prompt + output hits the cached blocks of the first run; had a block of
    # rejected drafts been cached, the continuation would read wrong KV.
    longer = [p + o for p, o in zip(prompts, first)]
    again = llm.generate([{"prompt_token_ids": p} for p in longer], GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens > len(p) for o, p in zip(again, prompts))
    assert [o.outputs[0].token_ids for o in again] == _hf_greedy(tiny_model, longer)
    assert first == _hf_greedy(tiny_model, prompts)


@pytest.fixture(scope="module")
def pair(tiny_model):
    return LLM(tiny_model, max_model_len=256), LLM(tiny_model, max_model_len=256, speculative_config=NGRAM)


def _same(pair, prompts, params):
    plain, spec = (llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False) for llm in pair)
    for a, b in zip(plain, spec):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].text == a.outputs[0].text
        assert (b.outputs[0].finish_reason, b.outputs[0].stop_reason) == (a.outputs[0].finish_reason,
                                                                        a.outputs[0].stop_reason)
    return plain


def test_max_tokens_cuts_inside_an_accepted_run(pair):
    for n in (1, 2, 5, 7):
        outs = _same(pair, _prompts(), SamplingParams(temperature=0.0, max_tokens=n))
        assert all(len(o.outputs[0].token_ids) == n for o in outs)


def test_max_model_len_cuts_inside_an_accepted_run(pair):
    # Repetitive prompts a few tokens short of max_model_len (drafts are accepted there).
    prompts = [(p * 10)[:256 - n] for p, n in zip(_prompts()[:2], (9, 14))] + [random_prompts([245], 1000, seed=8)[0]]
    # max_tokens=None: as many as max_model_len leaves; drafts must never reach past it.
    outs = _same(pair, prompts, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 14, 11]


def test_stop_token_and_stop_string_cut_inside_an_accepted_run(pair):
    prompts = _prompts()
    reference = _generate(pair[0], prompts)
    stop_ids = [r[5] for r in reference]  # a token each output reaches mid-way
    outs = _same(pair, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=stop_ids))
    assert any(o.outputs[0].stop_reason in stop_ids for o in outs)
    text = pair[0].generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    outs = _same(pair, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop=[stop]))
    assert outs[0].outputs[0].stop_reason == stop


def test_greedy_logprobs_equal_non_speculative(pair):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=2)
    plain, spec = (llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
                   for llm in pair)
    for a, b in zip(plain, spec):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            assert all(abs(la[t] - lb[t]) < 1e-4 for t in la)


def test_seeded_sampling_repeats_under_speculation(pair):
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=MAX_NEW, seed=11)
    first = _generate(pair[1], _prompts()[:2], params)
    assert _generate(pair[1], _prompts()[:2], params) == first


def test_min_tokens_bans_eos_at_every_verified_position(pair, tiny_model):
    eos = pair[0].engine.eos_token_ids
    prompts = _prompts()
    reference = _generate(pair[0], prompts)
    # Make a token each output reaches early a stop token, banned until min_tokens.
    stop_ids = sorted({r[2] for r in reference})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=stop_ids, min_tokens=6)
    outs = _same(pair, prompts, params)
    assert all(len(o.outputs[0].token_ids) >= 6 for o in outs)
    assert eos  # the model has EOS ids; min_tokens covers them too


def test_grammar_requests_do_not_speculate_and_keep_their_seeded_tokens(pair):
    """Requests under a grammar are verified one token at a time (no matcher rollback), in
    the same steps as speculating ones; a seeded one samples exactly what it samples alone."""
    from engine import StructuredOutputsParams
    from tests.engine.so_oracles import CODE_REGEX, assert_fullmatch

    so = StructuredOutputsParams(regex=CODE_REGEX)
    prompts = _prompts()
    params = [GREEDY] * len(prompts) + [SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs=so)
                                        for i in range(2)]
    batch = [{"prompt_token_ids": p} for p in prompts + prompts[:2]]
    drafts_before = _counter(pair[1], "vllm:spec_decode_num_draft_tokens")
    plain, spec = (llm.generate(batch, params, use_tqdm=False) for llm in pair)
    assert _counter(pair[1], "vllm:spec_decode_num_draft_tokens") > drafts_before
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    for out in spec[len(prompts):]:
        assert_fullmatch(out.outputs[0].text, CODE_REGEX)


def _draft(model: str) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": 3}


@pytest.mark.parametrize("engine_kwargs", [
    {"long_prefill_token_threshold": 7, "max_num_batched_tokens": 24},
    {"max_model_len": 128, "block_size": 8, "num_kv_blocks": 16, "enable_prefix_caching": False},
], ids=["chunked-prefill", "preemption"])
def test_target_as_its_own_draft_is_always_accepted(tiny_model, engine_kwargs):
    """The draft's KV (same block ids, prefilled with the target, recomputed after preemption)
    is right iff a draft identical to the target has every greedy draft accepted."""
    kwargs = {"max_model_len": 256, **engine_kwargs}
    llm = LLM(tiny_model, speculative_config=_draft(tiny_model), **kwargs)
    prompts = _prompts() + random_prompts([33, 17], 1000, seed=7)
    assert _generate(llm, prompts) == _hf_greedy(tiny_model, prompts)
    drafted = _counter(llm, "vllm:spec_decode_num_draft_tokens")
    assert drafted > 0
    assert _counter(llm, "vllm:spec_decode_num_accepted_tokens") == drafted
    if "num_kv_blocks" in engine_kwargs:
        assert _counter(llm, "vllm:num_preemptions") > 0
        assert llm.engine.core.kv_cache_manager.get_num_free_blocks() == 16


def test_another_draft_model_keeps_greedy_outputs_on_prefix_cache_hits(model_factory, tiny_model):
    draft = model_factory("qwen2")  # other weights, same tokenizer
    llm = LLM(tiny_model, max_model_len=256, block_size=4, speculative_config=_draft(draft))
    prompts = _prompts()
    first = _generate(llm, prompts)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in again)
    assert [o.outputs[0].token_ids for o in again] == first == _hf_greedy(tiny_model, prompts)
    # Random weights share nothing: its drafts are verified and (nearly all) rejected.
    assert _counter(llm, "vllm:spec_decode_num_draft_tokens") > 0


def test_tensor_parallel_ranks_verify_the_same_drafts(tiny_model):
    """Only the driver samples and proposes; every rank must append the same accepted runs."""
    prompts = _prompts()
    llm = LLM(tiny_model, max_model_len=256, tensor_parallel_size=2, speculative_config=NGRAM)
    try:
        assert _generate(llm, prompts) == _hf_greedy(tiny_model, prompts)
        assert _counter(llm, "vllm:spec_decode_num_accepted_tokens") > 0
    finally:
        llm.shutdown()
