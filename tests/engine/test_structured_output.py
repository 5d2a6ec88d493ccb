"""Structured outputs end to end on a random-weight model: it writes junk unless the mask
holds, so every valid output is the mask's doing. Oracles: jsonschema, re.fullmatch, the
choice list, and HF logits + llguidance's per-token check for the greedy reference. In the GPU
subset (tests/conftest.py): the engines run on the session's `device`."""

from __future__ import annotations

import json

import llguidance.hf
import pytest
import torch
from llguidance import LLMatcher

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.request import RequestStatus
from engine.structured_output.llguidance_backend import grammar_text
from tests.engine.hf_reference import _hf_model, random_prompts
from tests.engine.so_oracles import (
    CHOICES,
    CODE_REGEX,
    PERSON_SCHEMA,
    SUM_GRAMMAR,
    SUM_REGEX,
    assert_fullmatch,
    assert_valid_json,
)

JSON = StructuredOutputsParams(json=PERSON_SCHEMA)
REGEX = StructuredOutputsParams(regex=CODE_REGEX)
CHOICE = StructuredOutputsParams(choice=CHOICES)
GRAMMAR = StructuredOutputsParams(grammar=SUM_GRAMMAR)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def llm(tiny_model, device):
    # fp32 everywhere in this module: exact parity with the reference also on CUDA (whose
    # `auto` dtype is bf16), and the engines compared with each other share a dtype.
    return LLM(tiny_model, max_model_len=256, device=device, dtype="float32")


@pytest.fixture(scope="module")
def prompts(tiny_model):
    return [{"prompt_token_ids": p} for p in random_prompts([5, 9, 14, 7], 1000, seed=3)]


def _gen(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _assert_idle(llm):
    core = llm.engine.core
    assert not core.has_unfinished_requests()
    assert core.kv_cache_manager.get_num_free_blocks() == core.num_kv_blocks


def _sampled(so, seed, **kw):
    return SamplingParams(**{"temperature": 1.0, "seed": seed, "max_tokens": 60, "structured_outputs": so, **kw})


def test_sampled_outputs_satisfy_every_kind_of_constraint(llm, prompts):
    kinds = [(JSON, lambda t: assert_valid_json(t, PERSON_SCHEMA)),
             (REGEX, lambda t: assert_fullmatch(t, CODE_REGEX)),
             (CHOICE, lambda t: assert_fullmatch(t, "|".join(CHOICES))),
             (GRAMMAR, lambda t: assert_fullmatch(t, SUM_REGEX))]
    batch = [(p, so, check) for so, check in kinds for p in prompts]
    outs = _gen(llm, [p for p, _, _ in batch], [_sampled(so, i) for i, (_, so, _) in enumerate(batch)])
    for out, (_, _, check) in zip(outs, batch):
        assert out.finish_reason == "stop", out  # the grammar ended, then only EOS was allowed
        assert out.token_ids[-1] in llm.engine.eos_token_ids
        check(out.text)
    _assert_idle(llm)


def closing_bias(tokenizer) -> dict[int, float]:
    """logit_bias +100 (the most allowed) on the tokens `"`, `}` and `]`. A random-weight model
    left alone writes JSON strings without end, so a json_object output could not be required
    to stop; with the bias, a string ends as soon as `"` is drawn among the three closers and
    the object as soon as `}` is allowed, so a correct engine ends the object within a few
    dozen tokens, then stops (after the object the grammar allows only EOS). The bias cannot
    make JSON by itself: without the mask the sampler would write closers forever."""
    ids = {c: tokenizer.encode(c, add_special_tokens=False) for c in ('"', "}", "]")}
    assert all(len(i) == 1 for i in ids.values()), ids  # one token each, or the bias misses
    return {i[0]: 100.0 for i in ids.values()}


def test_json_object_ends_with_a_whole_json_object(llm, prompts):
    bias = closing_bias(llm.get_tokenizer())
    # 100 tokens: of 512 seeded draws on the tiny model all stopped, the longest after 31.
    outs = _gen(llm, prompts * 2, [_sampled(StructuredOutputsParams(json_object=True), i, max_tokens=100,
                                            logit_bias=bias) for i in range(2 * len(prompts))])
    for out in outs:
        assert out.finish_reason == "stop", out  # never cut by max_tokens: the object ended
        assert out.token_ids[-1] in llm.engine.eos_token_ids
        assert isinstance(json.loads(out.text), dict), out.text
    _assert_idle(llm)


def test_unconstrained_request_is_unaffected_by_constrained_neighbours(llm, prompts):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = _gen(llm, prompts[:1], plain)[0].token_ids
    mixed = _gen(llm, prompts, [plain, _sampled(JSON, 1), _sampled(REGEX, 2), _sampled(CHOICE, 3)])
    assert mixed[0].token_ids == alone


def _reference_constrained_greedy(model_dir, so, prompt, max_tokens, eos):
    """Greedy decoding with HF's logits, each step's allowed set found token by token
    (llguidance's validate_tokens on a matcher of our own, not the engine's bitmask path)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = _hf_model(model_dir)
    vocab = model.config.vocab_size
    matcher = LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos), grammar_text(so))
    ids, out, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            if matcher.is_stopped():  # the grammar is complete: only EOS may follow
                allowed = torch.tensor([t in eos for t in range(vocab)])
            else:
                allowed = torch.tensor([matcher.validate_tokens([t]) == 1 for t in range(vocab)])
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            out.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            if token in eos:
                break
            assert matcher.consume_token(token)
            ids.append(token)
    return out, logprobs


def test_constrained_greedy_equals_masked_argmax_reference_with_raw_logprobs(llm, prompts, tiny_model):
    so = REGEX
    out = _gen(llm, prompts[1:2], SamplingParams(temperature=0, max_tokens=20, logprobs=0, structured_outputs=so))[0]
    ref, ref_lp = _reference_constrained_greedy(tiny_model, so, prompts[1]["prompt_token_ids"], 20,
                                                llm.engine.eos_token_ids)
    assert out.token_ids == ref
    # Logprobs are the model's raw distribution (before the mask), as vLLM's default mode.
    got = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
    assert got == pytest.approx(ref_lp, abs=1e-4)


def test_preemption_keeps_the_matcher_in_step_with_the_output(tiny_model, llm, prompts, device):
    params = [_sampled(so, i, max_tokens=48) for i, so in enumerate([JSON, JSON, GRAMMAR, REGEX])]
    small = LLM(tiny_model, max_model_len=128, block_size=8, num_kv_blocks=16, enable_prefix_caching=False,
                device=device, dtype="float32")
    scheduler = small.engine.core.scheduler
    preempted = []
    original = scheduler._preempt
    scheduler._preempt = lambda r: (preempted.append(r.request_id), original(r))
    long_prompts = [{"prompt_token_ids": p["prompt_token_ids"] * 3} for p in prompts]
    expected = [o.token_ids for o in _gen(llm, long_prompts, params)]
    assert [o.token_ids for o in _gen(small, long_prompts, params)] == expected
    assert preempted, "the KV pool was meant to be small enough to force preemption"


def test_chunked_prefill_masks_only_the_sampling_chunk(tiny_model, llm, device):
    chunked = LLM(tiny_model, max_model_len=256, long_prefill_token_threshold=7, max_num_batched_tokens=24,
                  device=device, dtype="float32")
    long_prompts = [{"prompt_token_ids": p} for p in random_prompts([40, 23, 31], 1000, seed=5)]
    params = [_sampled(so, i) for i, so in enumerate([JSON, GRAMMAR, CHOICE])]
    assert ([o.token_ids for o in _gen(chunked, long_prompts, params)]
            == [o.token_ids for o in _gen(llm, long_prompts, params)])


def test_prefix_cache_hit_gives_the_same_constrained_output(llm, prompts):
    p = [{"prompt_token_ids": prompts[2]["prompt_token_ids"] * 4}]
    first = llm.generate(p, _sampled(JSON, 7), use_tqdm=False)[0]
    second = llm.generate(p, _sampled(JSON, 7), use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_stop_string_cuts_a_constrained_output(llm, prompts):
    out = _gen(llm, prompts[:1], _sampled(StructuredOutputsParams(regex="ab{3,6}c"), 0, stop=["bb"]))[0]
    assert out.text == "a" and out.finish_reason == "stop"
    _assert_idle(llm)


@pytest.mark.parametrize("kwargs", [dict(regex="a(b"), dict(json={"type": "foo"}),
                                    dict(grammar="start: nope")])
def test_invalid_spec_is_a_value_error_at_submit_and_nothing_is_queued(llm, prompts, kwargs):
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate(prompts[:1], SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs)),
                     use_tqdm=False)
    _assert_idle(llm)
    assert _gen(llm, prompts[:1], _sampled(CHOICE, 0))[0].text in CHOICES  # still serving


def test_request_waits_for_its_grammar_without_blocking_others(llm, prompts):
    """WAITING_FOR_FSM: hold the compile, and a plain request behind it still runs."""
    import threading

    core = llm.engine.core
    gate = threading.Event()
    manager = core.structured_output_manager
    original = manager._create_grammar
    manager._create_grammar = lambda *a: (gate.wait(30), original(*a))[1]
    try:
        llm.engine.add_request("held", prompts[0], _sampled(StructuredOutputsParams(regex="held[0-9]"), 0))
        llm.engine.add_request("plain", prompts[1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        finished = set()
        for _ in range(5):
            finished |= {o.request_id for o in llm.engine.step() if o.finished}
        assert finished == {"plain"}
        assert core.scheduler.requests["held"].status == RequestStatus.WAITING_FOR_FSM
    finally:
        manager._create_grammar = original
        gate.set()
    texts = {}
    while llm.engine.has_work():
        texts.update({o.request_id: o.outputs[0].text for o in llm.engine.step() if o.finished})
    assert_fullmatch(texts["held"], "held[0-9]")


def test_a_constraint_with_after_tokens_starts_after_them(llm, prompts, tiny_model):
    """A reasoning model's grammar starts after its `</think>` (after_tokens): the tokens up to
    and including them are the unconstrained greedy ones, the rest the constrained greedy
    continuation of that prefix (the masked-argmax reference)."""
    prompt = prompts[2]["prompt_token_ids"]
    free = _gen(llm, prompts[2:3], SamplingParams(temperature=0, max_tokens=6))[0].token_ids
    after = tuple(free[2:4])  # a two-token "</think>" the model writes on its own
    so = StructuredOutputsParams(regex=CODE_REGEX, after_tokens=after)
    out = _gen(llm, prompts[2:3], SamplingParams(temperature=0, max_tokens=20, structured_outputs=so))[0]
    assert out.token_ids[:4] == free[:4]
    ref, _ = _reference_constrained_greedy(tiny_model, REGEX, prompt + free[:4], 16, llm.engine.eos_token_ids)
    assert out.token_ids[4:] == ref
    # A P/D decode engine replays the tokens sampled before it: the constraint's start is found
    # among them, whether it came already or not yet.
    from engine.structured_output.request import split_after

    assert split_after(free[:5], after) == (False, free[4:5])
    assert split_after(free[:3], after) == (True, [])
    assert split_after(free[:3], None) == (False, free[:3])
    _assert_idle(llm)
