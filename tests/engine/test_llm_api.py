"""The offline API: vLLM-compatible calls, every stop condition end to end, and clear
ValueErrors (naming the field) for bad input that leave nothing queued."""

from __future__ import annotations

import logging

import pytest

from engine import LLM, SamplingParams
from kernels.cpu.build import level_in_use
from tests.engine.hf_reference import random_prompts


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, max_model_len=128)


def test_a_cpu_engine_names_its_kernels_level_at_start_and_in_its_load(tiny_model, caplog):
    with caplog.at_level(logging.INFO, logger="engine.core"):
        llm = LLM(tiny_model, max_model_len=128, device="cpu")
    level = level_in_use()
    assert level != "references"  # this machine has a compiler: the kernels are built
    assert f"; CPU kernels: {level}" in caplog.text
    assert llm.engine.core.load().cpu_kernels == level


def _greedy(llm, prompt, **kw):
    params = SamplingParams(temperature=0, **{"max_tokens": 16, **kw})
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def _assert_idle(llm):
    core = llm.engine.core
    assert not core.has_unfinished_requests()
    assert core.kv_cache_manager.get_num_free_blocks() == core.num_kv_blocks


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-2.1), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logit_bias={5: 101.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(bad_words=[""]), "bad_words"),
        (dict(bad_words="x"), "bad_words"),
        (dict(n=0), "n"),
        (dict(n=129), "n"),
        (dict(n=True), "n"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(seed="x"), "seed"),
        (dict(temperature="hot"), "temperature"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_prompt_longer_than_context_is_rejected_with_range(llm):
    with pytest.raises(ValueError, match=r"max_model_len is 128.*at most 127"):
        llm.generate([{"prompt_token_ids": [5] * 128}], use_tqdm=False)
    _assert_idle(llm)


def test_prompt_plus_max_tokens_beyond_context_is_rejected(llm):
    with pytest.raises(ValueError, match=r"max_tokens must be <= 28"):
        llm.generate([{"prompt_token_ids": [5] * 100}], SamplingParams(max_tokens=29), use_tqdm=False)


@pytest.mark.parametrize(
    "prompt, match",
    [("", "empty"), ({"prompt_token_ids": []}, "empty"), ({"prompt_token_ids": [5, 10**6]}, "prompt_token_ids"),
     ({"prompt_token_ids": "abc"}, "prompt_token_ids"), (42, "prompt")],
)
def test_bad_prompts_are_rejected(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], use_tqdm=False)


def test_stop_token_ids_outside_vocab_are_rejected(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["hi"], SamplingParams(stop_token_ids=[10**7]), use_tqdm=False)


def test_a_bad_prompt_in_a_batch_leaves_nothing_queued(llm):
    with pytest.raises(ValueError):
        llm.generate(["fine", "also fine", {"prompt_token_ids": [5] * 500}], use_tqdm=False)
    _assert_idle(llm)


def test_sampling_params_list_must_match_prompts(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_per_prompt_sampling_params_are_honoured(llm):
    outs = llm.generate(["a", "b"], [SamplingParams(max_tokens=3, ignore_eos=True),
                                     SamplingParams(max_tokens=7, ignore_eos=True)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7]
    _assert_idle(llm)


def test_text_and_token_prompts_give_the_same_result(llm):
    tok = llm.get_tokenizer()
    text = "The river ran quietly"
    a = _greedy(llm, text)
    b = _greedy(llm, {"prompt_token_ids": tok.encode(text)})
    assert a.token_ids == b.token_ids and a.text == b.text


def test_outputs_keep_prompt_order_and_ids(llm):
    prompts = random_prompts([5, 50, 9], 1000, seed=11)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=4), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts


def test_max_tokens_finishes_with_length(llm):
    out = _greedy(llm, "hello", max_tokens=5, ignore_eos=True)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_max_model_len_finishes_with_length(llm):
    out = _greedy(llm, {"prompt_token_ids": [7] * 120}, max_tokens=None, ignore_eos=True)
    assert len(out.token_ids) == 8 and out.finish_reason == "length"


def test_stop_token_id_finishes_with_stop_reason(llm):
    free = _greedy(llm, "The train left", ignore_eos=True)
    target = free.token_ids[3]
    out = _greedy(llm, "The train left", stop_token_ids=[target], ignore_eos=True)
    first = free.token_ids.index(target)
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_min_tokens_defers_stop_tokens(llm):
    free = _greedy(llm, "The train left", ignore_eos=True)
    target = free.token_ids[0]
    out = _greedy(llm, "The train left", stop_token_ids=[target], min_tokens=4, max_tokens=12, ignore_eos=True)
    assert len(out.token_ids) >= 4
    assert target not in out.token_ids[:3]


def test_eos_stops_unless_ignored(tiny_model):
    # Declare a token the model is known to produce (its third greedy token) as the EOS.
    llm = LLM(tiny_model, max_model_len=128)
    free = _greedy(llm, "Once upon a time", ignore_eos=True, max_tokens=8)
    eos = free.token_ids[2]
    llm.engine.processor.eos_token_ids = (eos,)
    stopped = _greedy(llm, "Once upon a time", max_tokens=8)
    ignored = _greedy(llm, "Once upon a time", max_tokens=8, ignore_eos=True)
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_stop_string_cuts_text_before_it(llm):
    free = _greedy(llm, "The market was busy", ignore_eos=True, max_tokens=24)
    assert len(free.text) > 6
    stop = free.text[3:6]
    out = _greedy(llm, "The market was busy", ignore_eos=True, max_tokens=24, stop=[stop])
    assert out.text == free.text[: free.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(free.token_ids)
    _assert_idle(llm)


def test_stop_string_kept_when_requested(llm):
    free = _greedy(llm, "The market was busy", ignore_eos=True, max_tokens=24)
    stop = free.text[3:6]
    out = _greedy(llm, "The market was busy", ignore_eos=True, max_tokens=24, stop=[stop],
                  include_stop_str_in_output=True)
    assert out.text == free.text[: free.text.index(stop) + len(stop)]


def test_logprobs_returned_per_token(llm):
    out = _greedy(llm, "hello", max_tokens=4, logprobs=2, ignore_eos=True)
    assert len(out.logprobs) == 4
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and max(entry.values()) == entry[tok]  # greedy picks the top
        assert 2 <= len(entry) <= 3 and all(v <= 0 for v in entry.values())


def test_prefix_cache_reports_cached_tokens(llm):
    prompt = {"prompt_token_ids": random_prompts([40], 1000, seed=12)[0]}
    llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    again = llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert again.num_cached_tokens == 32
    assert llm.engine.core.kv_cache_manager.stats.hits >= 32


def test_n_samples_are_n_requests_with_seeds_seed_plus_j(llm, tiny_model):
    """`n` > 1 (engine.parallel_sampling): greedy samples all equal HF's greedy tokens; sampled
    ones are exactly the n=1 requests with seed+j, in index order, and nothing stays queued."""
    from tests.engine.hf_reference import hf_greedy

    prompt = random_prompts([11], 200, seed=5)[0]
    greedy = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(n=3, temperature=0, max_tokens=8),
                          use_tqdm=False)[0]
    expected = hf_greedy(tiny_model, [prompt], 8)[0]
    assert [c.index for c in greedy.outputs] == [0, 1, 2]
    assert [c.token_ids for c in greedy.outputs] == [expected] * 3
    assert greedy.finished and greedy.prompt_token_ids == prompt

    params = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    both = llm.generate([{"prompt_token_ids": prompt}] * 2,
                        [SamplingParams(n=4, seed=7, **params), SamplingParams(n=1, seed=9, **params)],
                        use_tqdm=False)
    singles = llm.generate([{"prompt_token_ids": prompt}] * 4,
                           [SamplingParams(seed=7 + j, **params) for j in range(4)], use_tqdm=False)
    assert [c.token_ids for c in both[0].outputs] == [o.outputs[0].token_ids for o in singles]
    assert len({tuple(c.token_ids) for c in both[0].outputs}) > 1  # the samples differ
    assert len(both[1].outputs) == 1
    _assert_idle(llm)


def test_the_engine_api_takes_n_1_only(llm):
    with pytest.raises(ValueError, match="n=2"):
        llm.engine.add_request("direct", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(n=2))
    _assert_idle(llm)
