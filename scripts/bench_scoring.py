"""What scoring and penalties cost, each pair side by side in one process,
alternating which side goes first, since these machines are noisy:

1. prefill: one 512-token prompt, max_tokens=1, with prompt_logprobs=1 against without
   (goal <= 1.3x); prefix caching off so both sides compute every position;
2. the others' decode: 8 requests decoding 64 tokens each while a 512-token prompt arrives that
   does or does not ask for prompt logprobs (goal: the 8 slow down by <= 5%);
3. penalties: the same 8 requests with repetition, frequency and presence penalties and a
   logit_bias, against none (no goal; the cost of the batch adjustments).

    python scripts/bench_scoring.py                        # SmolLM2 (the default model)
    python scripts/bench_scoring.py --model small --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT_LEN, DECODERS, DECODE_TOKENS = 512, 8, 64


def _resolve(name: str) -> str:
    from engine.models.default_model import default_model, ensure_preset_model

    return default_model() if name == "default" else ensure_preset_model(name) if name in (
        "tiny", "small", "bench") else name


def _timed(llm, prompts, params) -> float:
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


def _pairs(run_a, run_b, repeats: int) -> tuple[list[float], list[float]]:
    """Each side `repeats` times, alternating which goes first."""
    a, b = [], []
    for i in range(repeats):
        for side in ((run_a, a), (run_b, b)) if i % 2 == 0 else ((run_b, b), (run_a, a)):
            side[1].append(side[0](i))
    return a, b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="default (SmolLM2), a preset, or a model path")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    from engine import LLM, SamplingParams
    from tests.engine.hf_reference import random_prompts

    llm = LLM(_resolve(args.model), max_model_len=1024, enable_prefix_caching=False,
              max_num_batched_tokens=PROMPT_LEN)
    V = llm.engine.core.arch.vocab_size
    # A fresh long prompt per run, so no side ever reuses the other's work.
    longs = random_prompts([PROMPT_LEN] * (2 * args.repeats + 1), V, seed=1)
    shorts = [{"prompt_token_ids": p} for p in random_prompts([32] * DECODERS, V, seed=2)]
    one = SamplingParams(temperature=0, max_tokens=1)
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    decode = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    penalized = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True, repetition_penalty=1.1,
                               frequency_penalty=0.5, presence_penalty=0.5,
                               logit_bias={t: 1.0 for t in range(100, 110)})
    _timed(llm, [{"prompt_token_ids": longs[-1]}], scored)  # warm-up

    def prefill(params):
        return lambda i: _timed(llm, [{"prompt_token_ids": longs[i]}], params)

    plain_s, scored_s = _pairs(prefill(one), prefill(scored), args.repeats)

    def mixed(params):
        # The long prompt arrives with the decoders: its prefill shares their steps.
        return lambda i: _timed(llm, shorts + [{"prompt_token_ids": longs[i]}], [decode] * DECODERS + [params])

    mixed_plain, mixed_scored = _pairs(mixed(one), mixed(scored), args.repeats)

    def decoders(params):
        return lambda i: _timed(llm, shorts, params)

    dec_plain, dec_pen = _pairs(decoders(decode), decoders(penalized), args.repeats)

    med = statistics.median
    result = {
        "model": args.model, "repeats": args.repeats,
        "prefill_512_s": {"plain": med(plain_s), "prompt_logprobs": med(scored_s),
                          "ratio": med(scored_s) / med(plain_s), "goal": 1.3},
        "decode_with_a_scored_prompt_s": {"plain": med(mixed_plain), "prompt_logprobs": med(mixed_scored),
                                          "ratio": med(mixed_scored) / med(mixed_plain), "goal": 1.05},
        "decode_penalties_s": {"plain": med(dec_plain), "penalties": med(dec_pen),
                               "ratio": med(dec_pen) / med(dec_plain)},
    }
    for name, r in result.items():
        if isinstance(r, dict):
            print(f"{name:32s} " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in r.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
