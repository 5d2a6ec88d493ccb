"""Scoring and sampling as real clients send them, through the official openai client, in P/D
and colocated mode: echo with prompt logprobs (lm-eval's loglikelihood request), max_tokens=0,
vLLM's prompt_logprobs, penalties and logit_bias.

Oracles: transformers' log-softmax over the whole prompt, and transformers' generate with the
same repetition penalty / sequence bias.
"""

from __future__ import annotations

import pytest
import requests
import torch

from tests.cluster.helpers import SHARED_NAME, assert_no_leaks, sse_events
from tests.engine.hf_reference import _hf_model, random_prompts

NAME = SHARED_NAME


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def _hf_logprobs(model_dir, ids):
    with torch.no_grad():
        return torch.log_softmax(_hf_model(model_dir)(torch.tensor([ids])).logits[0].float(), dim=-1)


PROMPTS = random_prompts([17, 5, 30], 1000, seed=41)


def test_echo_logprobs_of_token_prompts_match_transformers(client, tiny_model, tokenizer, app, mode, shared_app):
    """lm-eval's request: a batch of token-id prompts, echo, logprobs=1, max_tokens=1."""
    r = client.completions.create(model=NAME, prompt=PROMPTS, echo=True, logprobs=1, max_tokens=1, temperature=0)
    assert len(r.choices) == len(PROMPTS)
    for choice, ids in zip(sorted(r.choices, key=lambda c: c.index), PROMPTS):
        lp = choice.logprobs
        ref = _hf_logprobs(tiny_model, ids)
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.tokens[:len(ids)] == [tokenizer.decode([t]) for t in ids]
        want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(want, abs=1e-3)
        for i in range(1, len(ids)):
            top = int(ref[i - 1].argmax())
            assert lp.top_logprobs[i][tokenizer.decode([top])] == pytest.approx(ref[i - 1, top].item(), abs=1e-3)
        # The generated token: greedy, so the top of the last position.
        assert lp.token_logprobs[-1] == pytest.approx(ref[-1].max().item(), abs=1e-3)
        assert choice.text.startswith(tokenizer.decode(ids))
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert r.usage.prompt_tokens == sum(map(len, PROMPTS)) and r.usage.completion_tokens == len(PROMPTS)
    assert_no_leaks(app, shared_app.name, shared_app.roles)


def test_echo_with_max_tokens_zero_returns_only_the_scored_prompt(client, tiny_model, tokenizer):
    ids = PROMPTS[0]
    r = client.completions.create(model=NAME, prompt=ids, echo=True, logprobs=0, max_tokens=0)
    c = r.choices[0]
    assert c.text == tokenizer.decode(ids) and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == len(ids) and r.usage.completion_tokens == 0
    ref = _hf_logprobs(tiny_model, ids)
    assert c.logprobs.token_logprobs[1:] == pytest.approx([ref[i - 1, ids[i]].item() for i in range(1, len(ids))],
                                                          abs=1e-3)
    plain = client.completions.create(model=NAME, prompt="a text prompt", echo=True, max_tokens=0)
    assert plain.choices[0].text == "a text prompt" and plain.usage.completion_tokens == 0


def test_streamed_echo_sends_the_prompt_with_its_logprobs_first(app, tiny_model):
    ids = PROMPTS[1]
    body = {"model": NAME, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0,
            "stream": True}
    events = sse_events(requests.post(f"{app}/v1/completions", json=body, stream=True, timeout=60))
    assert events.pop() == "[DONE]"
    first = events[0]["choices"][0]
    assert first["logprobs"]["token_logprobs"][0] is None and len(first["logprobs"]["tokens"]) == len(ids)
    ref = _hf_logprobs(tiny_model, ids)
    assert first["logprobs"]["token_logprobs"][1:] == pytest.approx(
        [ref[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-3)
    generated = [t for e in events[1:] for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert len(generated) == 4


def test_chat_prompt_logprobs_extra_field(app, tiny_model, tokenizer):
    messages = [{"role": "user", "content": "Score this prompt"}]
    body = {"model": NAME, "messages": messages, "max_tokens": 2, "prompt_logprobs": 2}
    r = requests.post(f"{app}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()["prompt_logprobs"]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    ref = _hf_logprobs(tiny_model, ids)
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        entry = got[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-3)
        assert entry["rank"] == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
        assert entry["decoded_token"] == tokenizer.decode([ids[i]])
        assert len(got[i]) in (2, 3)


def _hf_generate(model_dir, ids, n, **kw):
    with torch.no_grad():
        out = _hf_model(model_dir).generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                            max_new_tokens=n, do_sample=False, **kw)
    return out[0, len(ids):].tolist()


def test_penalties_and_logit_bias_equal_transformers(client, tiny_model, tokenizer):
    ids = random_prompts([7], 1000, seed=42)[0] * 3  # repetitive: the penalty changes the path
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0,
                                  extra_body={"repetition_penalty": 1.8})
    want = _hf_generate(tiny_model, ids, 12, repetition_penalty=1.8)
    assert r.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)

    plain = _hf_generate(tiny_model, ids, 12)
    bias = {str(plain[0]): -100, str(plain[2]): 5}
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0, logit_bias=bias)
    want = _hf_generate(tiny_model, ids, 12, sequence_bias={(plain[0],): -100.0, (plain[2],): 5.0})
    assert r.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)


def test_presence_and_frequency_penalties_are_accepted_and_change_the_answer(client):
    ids = random_prompts([7], 1000, seed=42)[0] * 3
    base = dict(model=NAME, prompt=ids, max_tokens=16, temperature=0)
    plain = client.completions.create(**base).choices[0].text
    penalized = client.completions.create(**base, presence_penalty=2.0, frequency_penalty=2.0).choices[0].text
    assert penalized != plain
