"""Penalties, logit_bias, allowed_token_ids and bad_words: the batch adjustments against their
definitions on random logits, and greedy decoding against transformers' generate with the same
processors (its own repetition penalty, sequence bias and bad-words processors; frequency and
presence as OpenAI defines them, written here as a transformers LogitsProcessor)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from engine import LLM, SamplingParams
from engine.sample.penalties import bad_word_bans, build_adjustments
from tests.engine.hf_reference import _hf_model, random_prompts

V = 50


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, **kw})


def test_adjustments_follow_their_definitions_row_by_row():
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    params = [
        _params(repetition_penalty=1.7),
        _params(),  # untouched row between adjusted ones
        _params(frequency_penalty=0.6, presence_penalty=-0.4),
        _params(logit_bias={3: 5.0, 7: -100.0}, allowed_token_ids=[3, 7, 9, 11]),
        _params(repetition_penalty=0.8, frequency_penalty=-1.5, presence_penalty=2.0, logit_bias={0: 1.0}),
    ]
    token_ids = rng.integers(0, V, size=(8, 30))
    batch_rows = np.array([5, 0, 2, 7, 1])  # input-batch rows, not in order
    prompt_lens = np.array([6, 4, 10, 3, 8])
    output_starts = np.array([6, 4, 9, 3, 8])  # row 2: a P/D decode side, its prompt's last token generated
    ends = np.array([14, 4, 20, 9, 8])  # row 4 has generated nothing yet
    logits = torch.randn(5, V, generator=g) * 3
    adj = build_adjustments(params, token_ids, batch_rows, prompt_lens, output_starts, ends, V, torch.device("cpu"))
    got = logits.clone()
    adj.apply(got)

    want = logits.clone()
    for j, p in enumerate(params):
        toks = token_ids[batch_rows[j]]
        prompt, generated = toks[:prompt_lens[j]].tolist(), toks[output_starts[j]:ends[j]].tolist()
        row = want[j]
        if p.allowed_token_ids is not None:
            keep = torch.zeros(V, dtype=torch.bool)
            keep[p.allowed_token_ids] = True
            row[~keep] = float("-inf")
        for t, b in (p.logit_bias or {}).items():
            row[t] += b
        for t in set(prompt) | set(generated):
            if p.repetition_penalty != 1.0:
                row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        for t in set(generated):
            row[t] -= p.frequency_penalty * generated.count(t) + p.presence_penalty
    torch.testing.assert_close(got, want)
    assert torch.equal(got[1], logits[1])


def test_no_adjustments_when_no_row_asks():
    params = [_params(), _params(temperature=0.7)]
    toks = np.zeros((2, 4), dtype=np.int64)
    assert build_adjustments(params, toks, np.arange(2), np.ones(2, np.int64), np.ones(2, np.int64),
                             np.full(2, 3), V, torch.device("cpu")) is None


def test_bad_word_bans_need_the_words_start_just_generated():
    p = _params()
    object.__setattr__(p, "_bad_words_token_ids", ((5,), (1, 2, 3)))
    assert bad_word_bans(p, np.array([], dtype=np.int64)) == [5]
    assert bad_word_bans(p, np.array([9, 1, 2])) == [5, 3]
    assert bad_word_bans(p, np.array([1, 2, 9])) == [5]


class _OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency/presence penalties over the generated tokens, by definition."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        for t, c in zip(*torch.unique(input_ids[0, self.prompt_len:], return_counts=True)):
            scores[0, t] -= self.frequency * c + self.presence
        return scores


def _hf_generate(model_dir, prompt, max_new, **kw):
    with torch.no_grad():
        out = _hf_model(model_dir).generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                            dtype=torch.long), max_new_tokens=max_new, do_sample=False, **kw)
    return out[0, len(prompt):].tolist()


def _ours(llm, prompts, **kw):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, **kw), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, max_model_len=128)


# Repetitive prompts: the random model repeats itself, so penalties change its greedy path.
PROMPTS = [p * 3 for p in random_prompts([6, 9, 4], 1000, seed=31)]


def test_greedy_with_repetition_penalty_equals_transformers(llm, tiny_model):
    plain = _ours(llm, PROMPTS)
    got = _ours(llm, PROMPTS, repetition_penalty=1.8)
    assert got == [_hf_generate(tiny_model, p, 16, repetition_penalty=1.8) for p in PROMPTS]
    assert got != plain  # the penalty did change something


def test_greedy_with_frequency_and_presence_penalties_equals_the_definition(llm, tiny_model):
    got = _ours(llm, PROMPTS, frequency_penalty=1.2, presence_penalty=0.5)
    want = [_hf_generate(tiny_model, p, 16, logits_processor=LogitsProcessorList([_OpenAIPenalties(len(p), 1.2, 0.5)]))
            for p in PROMPTS]
    assert got == want
    assert got != _ours(llm, PROMPTS)


def test_greedy_with_logit_bias_and_bad_words_equals_transformers(llm, tiny_model):
    plain = _ours(llm, PROMPTS)
    favoured, banned = plain[0][3], plain[1][0]
    got = _ours(llm, PROMPTS, logit_bias={favoured: 4.0, banned: -100.0})
    want = [_hf_generate(tiny_model, p, 16, sequence_bias={(favoured,): 4.0, (banned,): -100.0}) for p in PROMPTS]
    assert got == want and got != plain

    # A word the tokenizer writes as one token that the plain run chose, so banning it must
    # change that row, and the token must then appear in no output.
    tokenizer, processor = llm.get_tokenizer(), llm.engine.processor
    whole = [t for t in plain[2] if (t,) in processor._bad_words_ids([tokenizer.decode([t])])]
    assert whole, f"no token of {plain[2]} decodes to a word that encodes back to it alone"
    token = whole[0]
    word = tokenizer.decode([token])
    got = _ours(llm, PROMPTS, bad_words=[word])
    seqs = [list(s) for s in processor._bad_words_ids([word])]
    assert got == [_hf_generate(tiny_model, p, 16, bad_words_ids=seqs) for p in PROMPTS]
    assert all(token not in g for g in got) and got[2] != plain[2], (word, token, got)


def test_allowed_token_ids_limit_every_token(llm):
    allowed = [17, 23, 101, 400]
    for toks in _ours(llm, PROMPTS, allowed_token_ids=allowed):
        assert toks and set(toks) <= set(allowed)


def test_penalties_apply_per_verified_position_under_speculation(tiny_model, llm):
    spec = LLM(tiny_model, max_model_len=128, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1})
    kw = dict(repetition_penalty=1.3, frequency_penalty=0.4)
    assert _ours(spec, PROMPTS, **kw) == _ours(llm, PROMPTS, **kw)


@pytest.mark.parametrize("kw, field", [
    (dict(logit_bias={10**6: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[1, 10**6]), "allowed_token_ids"),
])
def test_token_ids_outside_the_vocabulary_are_rejected(llm, kw, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(["hi"], SamplingParams(**kw), use_tqdm=False)
