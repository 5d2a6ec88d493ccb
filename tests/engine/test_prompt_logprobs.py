"""SamplingParams.prompt_logprobs against transformers' own logits of the whole prompt: every
position's logprob, rank and top-k, whatever the chunking, prefix-cache or preemption state."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.hf_reference import _hf_model, random_prompts


def _hf_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), V] log-softmax of transformers' logits at every prompt position."""
    with torch.no_grad():
        logits = _hf_model(model_dir)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _check(model_dir: str, prompt: list[int], got, k: int) -> None:
    ref = _hf_logprobs(model_dir, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        row, tok, entry = ref[i - 1], prompt[i], got[i]
        assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(k)
        for r, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[t].logprob == pytest.approx(v, abs=1e-4) and entry[t].rank == r
        # The prompt's token plus the top k: k or k + 1 entries.
        assert len(entry) in (k, k + 1)


def _run(llm, prompts, **kw):
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, **kw)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_prompt_logprobs_match_transformers_under_chunked_prefill(tiny_model):
    # 8-token chunks: a 45-token prompt is scored over six steps, each under its own budget.
    llm = LLM(tiny_model, max_model_len=128, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    prompts = random_prompts([45, 9, 2, 1], 1000, seed=21)
    outs = _run(llm, prompts, prompt_logprobs=3)
    for p, out in zip(prompts, outs):
        _check(tiny_model, p, out.prompt_logprobs, 3)
        assert all(lp.decoded_token == llm.get_tokenizer().decode([t])
                   for e in out.prompt_logprobs[1:] for t, lp in e.items())
    assert outs[3].prompt_logprobs == [None]  # one token: nothing before it
    # The completion is unchanged by scoring the prompt.
    plain = _run(llm, prompts)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)


def test_prompt_logprobs_zero_gives_only_the_prompt_tokens(tiny_model):
    llm = LLM(tiny_model, max_model_len=64)
    prompt = random_prompts([12], 1000, seed=22)[0]
    out = _run(llm, [prompt], prompt_logprobs=0)[0]
    assert [list(e) for e in out.prompt_logprobs[1:]] == [[t] for t in prompt[1:]]
    _check(tiny_model, prompt, out.prompt_logprobs, 0)


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(tiny_model):
    llm = LLM(tiny_model, max_model_len=128)
    prompt = random_prompts([50], 1000, seed=23)[0]
    _run(llm, [prompt])
    again = _run(llm, [prompt])[0]
    assert again.num_cached_tokens == 48  # the prefix is cached...
    scored = _run(llm, [prompt], prompt_logprobs=2)[0]
    assert scored.num_cached_tokens == 0  # ...but not used by a request that scores the prompt
    _check(tiny_model, prompt, scored.prompt_logprobs, 2)
    assert scored.outputs[0].token_ids == again.outputs[0].token_ids


def test_prompt_logprobs_survive_preemption(tiny_model):
    llm = LLM(tiny_model, max_model_len=64, block_size=8, num_kv_blocks=12, enable_prefix_caching=False,
              max_num_batched_tokens=32, long_prefill_token_threshold=16)
    prompts = random_prompts([40, 36, 30, 25], 1000, seed=24)
    preempted_in_prefill = []
    scheduler = llm.engine.core.scheduler
    original = scheduler._preempt

    def counting(request):
        if not request.output_token_ids:
            preempted_in_prefill.append(request.request_id)
        original(request)

    scheduler._preempt = counting
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert preempted_in_prefill, "the KV pool was meant to preempt a request while it prefilled"
    for p, out in zip(prompts, outs):
        _check(tiny_model, p, out.prompt_logprobs, 1)
    assert llm.engine.core.kv_cache_manager.get_num_free_blocks() == 12


def test_n_samples_share_the_first_samples_prompt_logprobs(tiny_model):
    llm = LLM(tiny_model, max_model_len=64)
    prompt = random_prompts([10], 1000, seed=25)[0]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(n=3, max_tokens=3, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3
    _check(tiny_model, prompt, out.prompt_logprobs, 1)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprob_counts_above_max_logprobs_are_rejected(tiny_model, field):
    llm = LLM(tiny_model, max_model_len=64, max_logprobs=5)
    with pytest.raises(ValueError, match=rf"{field} must be at most max_logprobs \(5\), got 6"):
        llm.generate(["hi"], SamplingParams(**{field: 6}), use_tqdm=False)
    out = llm.generate(["hi"], SamplingParams(max_tokens=1, **{field: 5}), use_tqdm=False)[0]
    assert out.outputs[0].token_ids
