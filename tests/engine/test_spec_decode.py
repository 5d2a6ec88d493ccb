"""Speculative decoding end to end: greedy outputs equal non-speculative decoding and
Hugging Face `generate` token for token (drafts actually accepted), under chunked prefill,
prefix-cache hits and preemption; stops inside an accepted run cut exactly where
non-speculative decoding stops, and a drafted EOS is refused before min_tokens; sampled tokens,
bonus tokens included, follow a softmax of transformers' logits at every position."""

from __future__ import annotations

import functools
import json
import math
import os
import shutil

import pytest
import torch

import engine.worker.model_runner as model_runner
from engine import LLM, SamplingParams
from engine.metrics import Counter
from engine.sample.rejection_sampler import rejection_sample
from tests.engine.hf_reference import _hf_model, hf_greedy, random_prompts

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


@pytest.mark.gpu
@pytest.mark.parametrize("engine_kwargs", [
    {},
    {"long_prefill_token_threshold": 7, "max_num_batched_tokens": 24},
    {"max_num_batched_tokens": 3, "max_num_seqs": 2},  # the budget cuts drafts short
], ids=["plain", "chunked-prefill", "tight-budget"])
def test_greedy_with_ngram_speculation_matches_transformers(tiny_model, engine_kwargs):
    prompts = _prompts()
    # fp32: exact parity with transformers also on CUDA, whose `auto` dtype is bf16.
    llm = LLM(tiny_model, max_model_len=256, speculative_config=NGRAM, dtype="float32", **engine_kwargs)
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


@pytest.fixture
def drafted(monkeypatch) -> list[list[int]]:
    """Every request's drafts the rejection sampler verifies, step after step (in-process engines)."""
    seen: list[list[int]] = []

    def recording(logits, meta, drafts, *args):
        seen.extend(drafts)
        return rejection_sample(logits, meta, drafts, *args)

    monkeypatch.setattr(model_runner, "rejection_sample", recording)
    return seen


def _drafted_new_token(greedy: list[int]) -> int:
    """A position of `greedy` whose token is new to the output and which the first verification
    step drafts behind another draft: its row (pos_in_req >= 1) is not the step's first, which
    carries no drafts' positions. A draft model identical to the target drafts exactly it."""
    return next(j for j in range(2, 4) if greedy[j] not in greedy[:j])


def test_min_tokens_bans_a_drafted_stop_token(pair, tiny_model, drafted):
    prompt = _prompts()[0]
    greedy = _hf_greedy(tiny_model, [prompt])[0]
    pos = _drafted_new_token(greedy)
    spec = LLM(tiny_model, max_model_len=256, speculative_config=_draft(tiny_model))
    params = dict(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=[greedy[pos]])
    # Without min_tokens both stop at the stop token.
    assert _same((pair[0], spec), [prompt], SamplingParams(**params))[0].outputs[0].token_ids == greedy[:pos + 1]
    drafted.clear()
    out = _same((pair[0], spec), [prompt], SamplingParams(**params, min_tokens=pos + 4))[0].outputs[0]
    assert [greedy[pos]] in [d[pos - 1:pos] for d in drafted], "the stop token was meant to be drafted"
    assert greedy[pos] not in out.token_ids[:pos + 4] and len(out.token_ids) >= pos + 4


def _with_eos(model: str, eos: int, out_dir) -> str:
    """A copy of `model` whose EOS is `eos` (config.json and generation_config.json, where
    both the engine and transformers read it); same weights, same tokenizer."""
    shutil.copytree(model, out_dir)
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(out_dir, name)
        with open(path) as f:
            config = json.load(f)
        config["eos_token_id"] = eos
        with open(path, "w") as f:
            json.dump(config, f)
    return str(out_dir)


def test_min_tokens_and_ignore_eos_hold_when_eos_is_the_drafted_top_token(tiny_model, tmp_path, drafted):
    """EOS made the greedy choice at a drafted position: a draft model identical to the target
    drafts it, so only the ban on its verification row (min_tokens) keeps it out, and only
    ignore_eos keeps an accepted EOS from ending the request."""
    from transformers import GenerationConfig

    prompt = _prompts()[0]
    greedy = _hf_greedy(tiny_model, [prompt])[0]
    assert len(greedy) == MAX_NEW  # the model's own EOS never comes
    pos = _drafted_new_token(greedy)
    eos = greedy[pos]
    model = _with_eos(tiny_model, eos, tmp_path / "eos-model")
    engines = (LLM(model, max_model_len=256), LLM(model, max_model_len=256, speculative_config=_draft(model)))

    def run(params):
        drafted.clear()
        out = _same(engines, [prompt], params)[0].outputs[0]
        assert [eos] in [d[pos - 1:pos] for d in drafted], "EOS was meant to be drafted"
        return out

    # Unbanned, EOS is the top token at `pos`: the request stops there, as in transformers.
    stopped = _same(engines, [prompt], GREEDY)[0].outputs[0]
    assert (stopped.token_ids, stopped.finish_reason) == (greedy[:pos + 1], "stop")
    assert stopped.token_ids == _hf_greedy(model, [prompt])[0]

    min_tokens = pos + 4
    banned = run(SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=min_tokens))
    with torch.no_grad():
        ids = _hf_model(model).generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=GenerationConfig(max_new_tokens=MAX_NEW, min_new_tokens=min_tokens, do_sample=False,
                                               eos_token_id=eos))
    assert banned.token_ids == ids[0, len(prompt):].tolist()
    assert eos not in banned.token_ids[:min_tokens]

    # ignore_eos: the drafted EOS is accepted and the request goes on, token for token the
    # original model's greedy output.
    ignored = run(SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    assert (ignored.token_ids, ignored.finish_reason) == (greedy, "length")
    assert _counter(engines[1], "vllm:spec_decode_num_accepted_tokens") > 0


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


# Sampled mode, end to end: every emitted token, accepted draft, recovered token or bonus
# token, has the target's own distribution given the tokens before it, checked against a
# softmax of transformers' logits computed here. The randomised probability integral transform
# of each token (tokens ranked by descending probability) is exactly Uniform(0, 1) when the
# token is drawn from that softmax, whatever the prefix; a sampler that favours the likely
# tokens, or the drafts, pushes it down. The Kolmogorov-Smirnov distance of N such values from
# the uniform exceeds DKW's bound sqrt(ln(2 / ALPHA) / 2N) with probability at most ALPHA
# (Dvoretzky-Kiefer-Wolfowitz with Massart's constant), so the checks below, seven per run,
# fail a correct sampler with probability below 1e-5; the seeds are fixed, so a run that
# passes passes every time.
SAMPLED_K = 2
# The tiny random model's logits are flat (the top token has ~1% at temperature 1): at this
# temperature the top token has 30-70%, so drafts are accepted and bonus tokens are common.
SAMPLED_T = 0.12
N_SAMPLED = 1200
SAMPLED_LEN = 2 * (SAMPLED_K + 1)  # the prefill's token and two verification steps' worth
ALPHA = 1e-6


def _dkw_bound(n: int) -> float:
    return math.sqrt(math.log(2 / ALPHA) / (2 * n))


def _ks_distance(u: torch.Tensor) -> float:
    """sup |F_n(x) - x| of the values u [n] in [0, 1]."""
    u = u.sort().values
    i = torch.arange(1, len(u) + 1, dtype=torch.float64)
    return max(float((i / len(u) - u).max()), float((u - (i - 1) / len(u)).max()))


def _pit(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """probs [N, L, V], tokens [N, L] -> U [N, L]: the mass of the tokens likelier than the
    token, plus an independent uniform share of its own."""
    p_token = probs.gather(2, tokens[..., None])[..., 0]
    above = (probs * (probs > p_token[..., None])).sum(-1)
    return above + torch.rand(tokens.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * p_token


@pytest.fixture(scope="module")
def sampled(tiny_model):
    """N_SAMPLED requests of one prompt sampled under speculation (a draft model identical to
    the target: its drafts are the target's argmax, accepted often at this temperature):
    (tokens [N, L], transformers' softmax at each of their positions [N, L, V], the engine's
    accepted drafts per position)."""
    prompt = random_prompts([7], 1000, seed=9)[0] * 2
    # Every prompt prefills in one step and every draft fits the budget: the step after the
    # prefill verifies exactly SAMPLED_K drafts per request.
    llm = LLM(tiny_model, max_model_len=64, max_num_seqs=N_SAMPLED, max_num_batched_tokens=N_SAMPLED * len(prompt),
              speculative_config={"method": "draft_model", "model": tiny_model, "num_speculative_tokens": SAMPLED_K})
    torch.manual_seed(0)  # the draws of the requests without a seed (the engine runs in this process)
    # Even requests bring a seed (their rows draw from their own generator), odd ones do not.
    params = [SamplingParams(temperature=SAMPLED_T, max_tokens=SAMPLED_LEN, ignore_eos=True,
                             seed=i if i % 2 == 0 else None) for i in range(N_SAMPLED)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * N_SAMPLED, params, use_tqdm=False)
    tokens = torch.tensor([o.outputs[0].token_ids for o in outs])
    with torch.no_grad():
        ids = torch.cat([torch.tensor(prompt).expand(N_SAMPLED, -1), tokens[:, :-1]], dim=1)
        logits = _hf_model(tiny_model)(ids).logits[:, len(prompt) - 1:]  # [N, L, V]
    probs = torch.softmax(logits.double() / SAMPLED_T, dim=-1)
    per_pos = [m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos"]
    return tokens, probs, per_pos


def _bonus_rows(tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """[N] bool: requests whose first verification step accepted all its drafts. The drafts
    are the target's argmax at positions 1..K; a rejected draft is replaced by a token drawn
    from the rest of the distribution, never the draft itself, so all were accepted iff those
    tokens are the argmax, and then token K + 1 is the bonus token."""
    k = SAMPLED_K
    return (tokens[:, 1:k + 1] == probs[:, 1:k + 1].argmax(dim=-1)).all(dim=1)


def test_sampled_tokens_follow_the_target_softmax_at_every_position(sampled):
    tokens, probs, per_pos = sampled
    assert per_pos[SAMPLED_K - 1] > 0, "runs of all drafts accepted were meant to happen"
    u = _pit(probs, tokens)
    for pos in range(SAMPLED_LEN):
        assert _ks_distance(u[:, pos]) < _dkw_bound(N_SAMPLED), f"position {pos}"


def test_bonus_tokens_follow_the_target_softmax(sampled):
    tokens, probs, _ = sampled
    bonus = _bonus_rows(tokens, probs)
    n = int(bonus.sum())
    assert n >= 200
    u = _pit(probs, tokens)[bonus, SAMPLED_K + 1]
    assert _ks_distance(u) < _dkw_bound(n)


def test_a_greedy_bonus_token_would_fail_the_bound(sampled):
    """The oracle can fail: the same draws with each bonus token replaced by the target's
    argmax (a sampler that took the bonus token greedily) are far from the softmax."""
    tokens, probs, _ = sampled
    bonus = _bonus_rows(tokens, probs)
    wrong = tokens.clone()
    wrong[bonus, SAMPLED_K + 1] = probs[bonus, SAMPLED_K + 1].argmax(dim=-1)
    assert _ks_distance(_pit(probs, wrong)[bonus, SAMPLED_K + 1]) > _dkw_bound(int(bonus.sum()))
