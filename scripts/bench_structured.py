"""Offline throughput with and without a JSON-schema constraint (the goal: constrained
>= 0.8x unconstrained at batch 8), measured side by side in one process on each model, plus
what the constraint costs per step: filling the batch's bitmask (scheduler side) and applying
it to the logits (sampler side).

Both sides run the same 8 chat prompts, greedy, with `ignore_eos` and the same max_tokens, so
both produce exactly max_tokens tokens per request. The schema asks for at least 16 countries,
more than max_tokens can hold, so the grammar stays open for the whole run (the script checks:
if a matcher had finished, its request could only emit EOS from then on, and the report says
how many tokens were generated under an open grammar). The two sides alternate within each
repeat (which goes first alternates too) because these machines are noisy.

    python scripts/bench_structured.py                      # small preset + SmolLM2 (default model)
    python scripts/bench_structured.py --models small --repeats 5 --max-tokens 128
    python scripts/bench_structured.py --models /path/to/model_dir_or.gguf --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GOAL = 0.8
BATCH = 8
COUNTRIES = ["France", "Spain", "Italy", "Japan", "Brazil", "Canada", "Kenya", "Norway"]
SCHEMA = {
    "type": "object",
    "properties": {"countries": {
        "type": "array", "minItems": 16,
        "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 20},
                           "capital": {"type": "string", "maxLength": 20},
                           "population_millions": {"type": "number"}},
            "required": ["name", "capital", "population_millions"],
            "additionalProperties": False,
        },
    }},
    "required": ["countries"],
    "additionalProperties": False,
}


class _Timer:
    """Wraps a function, accumulating its wall time over the calls `counts` accepts."""

    def __init__(self, fn, counts=lambda result: True) -> None:
        self.fn, self.counts = fn, counts
        self.total_s, self.calls = 0.0, 0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        result = self.fn(*args, **kwargs)
        dt = time.perf_counter() - t0
        if self.counts(result):
            self.total_s += dt
            self.calls += 1
        return result

    def reset(self) -> None:
        self.total_s, self.calls = 0.0, 0

    @property
    def mean_ms(self) -> float:
        return 1e3 * self.total_s / self.calls if self.calls else float("nan")


def _resolve(name: str) -> tuple[str, str]:
    from engine.models.default_model import DEFAULT_MODEL_NAME, default_model, ensure_preset_model

    if name == "default":
        return DEFAULT_MODEL_NAME, default_model()
    if name in ("tiny", "small", "bench", "1b"):
        return f"{name} preset", ensure_preset_model(name)
    return os.path.basename(os.path.normpath(name)), name


def _prompts(tokenizer) -> list[dict]:
    out = []
    for country in COUNTRIES:
        q = f"List countries as JSON with their capital and population in millions, starting with {country}."
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            tokenize=True)
        out.append({"prompt_token_ids": list(ids["input_ids"] if hasattr(ids, "keys") else ids)})
    return out


def bench_model(name: str, path: str, max_tokens: int, repeats: int) -> dict:
    import kernels
    from engine import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(path, max_num_seqs=BATCH, max_model_len=1024, enable_prefix_caching=False)
    prompts = _prompts(llm.get_tokenizer())
    plain = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    # Per-step cost, timed in the run itself: fill = the scheduler's call that fills the batch
    # bitmask (steps with a constrained row only), apply = the sampler's masking kernel.
    manager = llm.engine.core.structured_output_manager
    fill = _Timer(manager.grammar_bitmask, counts=lambda result: result[1] is not None)
    manager.grammar_bitmask = fill
    apply = _Timer(kernels.apply_token_bitmask)
    kernels.apply_token_bitmask = apply
    eos = set(llm.engine.eos_token_ids)

    def run(params) -> tuple[float, int, int]:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        ids = [o.outputs[0].token_ids for o in outs]
        assert all(len(t) == max_tokens for t in ids), "a request did not run to max_tokens"
        # Tokens before the first EOS: under a constraint, those sampled with the grammar open.
        open_tokens = sum(next((i for i, t in enumerate(t_ids) if t in eos), len(t_ids)) for t_ids in ids)
        return elapsed, sum(len(t) for t in ids), open_tokens

    run(plain), run(constrained)  # warm-up: first-touch allocations, the grammar's compile
    fill.reset(), apply.reset()
    rows = []
    for r in range(repeats):
        order = ("plain", "constrained") if r % 2 == 0 else ("constrained", "plain")
        res = {side: run(plain if side == "plain" else constrained) for side in order}
        p_s, p_tok, _ = res["plain"]
        c_s, c_tok, c_open = res["constrained"]
        rows.append({"plain_tok_s": p_tok / p_s, "constrained_tok_s": c_tok / c_s,
                     "ratio": (c_tok / c_s) / (p_tok / p_s), "open_frac": c_open / c_tok,
                     "plain_step_ms": 1e3 * p_s / max_tokens, "constrained_step_ms": 1e3 * c_s / max_tokens})
    llm.engine.core.shutdown()
    ratios = [row["ratio"] for row in rows]
    return {"model": name, "vocab": llm.engine.core.arch.vocab_size, "max_tokens": max_tokens, "batch": BATCH,
            "repeats": rows, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "fill_ms": fill.mean_ms, "apply_ms": apply.mean_ms,
            "pass": statistics.median(ratios) >= GOAL}


def report(result: dict) -> None:
    print(f"\n{result['model']} (vocab {result['vocab']}), batch {result['batch']}, "
          f"{result['max_tokens']} tokens/request, greedy, ignore_eos")
    print(f"{'repeat':>6} {'plain tok/s':>12} {'json tok/s':>11} {'ratio':>6} {'step ms plain/json':>19} "
          f"{'grammar open':>12}")
    for i, row in enumerate(result["repeats"], 1):
        print(f"{i:>6} {row['plain_tok_s']:>12.1f} {row['constrained_tok_s']:>11.1f} {row['ratio']:>6.2f} "
              f"{row['plain_step_ms']:>9.1f} / {row['constrained_step_ms']:<7.1f} {row['open_frac']:>12.0%}")
    verdict = "PASS" if result["pass"] else "FAIL"
    print(f"ratio median {result['ratio_median']:.2f} (spread {result['ratio_min']:.2f}-{result['ratio_max']:.2f}), "
          f"goal >= {GOAL}: {verdict}")
    print(f"per step at batch {result['batch']}: mask fill {result['fill_ms']:.2f} ms, "
          f"apply {result['apply_ms']:.2f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="small,default",
                    help="comma-separated: a preset (tiny, small, bench, 1b), 'default' (SmolLM2) or a path")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's); a Ray engine replica gets 1")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    if args.threads:
        import torch

        # NOTE: on a shared 2-core machine, 2 OpenMP threads that must both get a core every
        # step make each step wait for the busiest neighbour; 1 thread does not.
        torch.set_num_threads(args.threads)
    results = []
    for name in args.models.split(","):
        label, path = _resolve(name.strip())
        results.append(bench_model(label, path, args.max_tokens, args.repeats))
        report(results[-1])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["pass"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
