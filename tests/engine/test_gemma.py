"""Gemma 2 / Gemma 3 checkpoints (Gemma2ForCausalLM, Gemma3ForCausalLM text): GeGLU, (1 + w)
norms around both sublayers, embedding scaling, query_pre_attn_scalar, soft-capping, and
sliding-window layers (Gemma 3: with their own rope base), against transformers running the
same checkpoint on prompts several windows long."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.arch import load_arch
from tests.engine.hf_reference import _hf_model, hf_greedy, random_prompts

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
# make-model's Gemma: window 16 on every other layer (the first included).
VARIANTS = {
    "gemma2": ("gemma2", {}),
    # Caps low enough that the tanh bends most scores and logits. A missing attention cap
    # changes the tokens; a missing final cap cannot (tanh keeps the logits' order), but it
    # changes every logprob, which the test checks too.
    "gemma2-tight-caps": ("gemma2", dict(attn_logit_softcapping=1.5, final_logit_softcapping=2.0)),
    "gemma3": ("gemma3", {}),
    "gemma3-window-not-a-block-multiple": ("gemma3", dict(sliding_window=11)),
}


def _generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# fp32 on both sides: only the summation order differs (measured within 2e-6 on CPU).
LOGPROB_TOL = 1e-4
TOP = 5


def _assert_logprobs_match_transformers(model: str, prompts: list[list[int]], outs) -> None:
    """Each generated position's logprobs (the token's and the top TOP) equal transformers'
    log-softmax of its logits, the prompt and the tokens before read in one pass."""
    for p, out in zip(prompts, outs):
        got = out.outputs[0]
        ids = p + list(got.token_ids)
        with torch.no_grad():
            ref = torch.log_softmax(_hf_model(model)(torch.tensor([ids])).logits[0, len(p) - 1:-1].float(), -1)
        assert len(got.logprobs) == len(got.token_ids) == ref.shape[0]
        for step, (token, entry) in enumerate(zip(got.token_ids, got.logprobs)):
            top = ref[step].topk(TOP)
            # The token and the top TOP (near-ties at the TOP-th place may swap).
            assert len(entry) == len({token, *top.indices.tolist()}) and token in entry, (step, sorted(entry))
            assert all(float(ref[step, t]) >= float(top.values[-1]) - LOGPROB_TOL for t in entry if t != token)
            for t, lp in entry.items():
                assert abs(lp - float(ref[step, t])) <= LOGPROB_TOL, (step, t, lp, float(ref[step, t]))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_tokens_and_their_logprobs_match_transformers(model_factory, variant):
    family, overrides = VARIANTS[variant]
    model = model_factory(family, **overrides)
    llm = LLM(model, max_model_len=256)
    prompts = random_prompts([3, 17, 40, 90, 5], 1000)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=TOP), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, prompts, MAX_NEW)
    _assert_logprobs_match_transformers(model, prompts, outs)


def test_the_model_is_what_the_variants_claim(model_factory):
    g2 = load_arch(model_factory("gemma2"))
    assert g2.layer_windows == (16, 0) and g2.attn_softcap == 50.0 and g2.final_softcap == 30.0
    assert g2.hidden_act == "gelu_tanh" and g2.norm_plus_one and g2.tie_word_embeddings
    assert g2.attn_scale != g2.head_dim**-0.5
    g3 = load_arch(model_factory("gemma3"))
    assert g3.layer_windows == (16, 0) and g3.qk_norm and not g3.attn_softcap
    assert (g3.rope_theta, g3.local_rope_theta) == (1e6, 1e4) and g3.rope_scaling_dict["factor"] == 8.0


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_chunked_prefill_and_prefix_cache_hits_match_transformers(model_factory, family):
    """Chunks that start inside and past the window, and prefix hits many windows long."""
    model = model_factory(family)
    llm = LLM(model, max_model_len=256, long_prefill_token_threshold=7, max_num_batched_tokens=24,
              enable_prefix_caching=True)
    shared = random_prompts([70], 1000, seed=3)[0]
    prompts = [shared + tail for tail in random_prompts([1, 9, 30], 1000, seed=4)]
    first = _generate(llm, prompts)
    second = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= 64 for o in second)
    assert [o.outputs[0].token_ids for o in second] == first == hf_greedy(model, prompts, MAX_NEW)
