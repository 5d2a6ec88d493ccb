"""Speculative decoding on a copy-heavy workload: decode tokens/s with and without n-gram
speculation at batch 1 and 8, side by side in one run (these machines are noisy), plus the
mean acceptance length (tokens emitted per verification step).

The workload asks the model to rewrite a given passage, so the output repeats spans of the
prompt: what prompt lookup is for. Greedy decoding, so both engines produce the same tokens
(the script checks it) and only the time differs.

    python scripts/bench_spec.py                        # SmolLM2-135M-Instruct (GGUF Q4_1), CPU
    python scripts/bench_spec.py --model DIR --k 4 --batch-sizes 1 8 --repeats 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PASSAGE = (
    "The lighthouse stood at the end of a narrow spit of rock, and for eighty years its keepers had "
    "climbed the same one hundred and twelve steps every evening to light the lamp. The last keeper, "
    "a quiet man named Elias Brand, kept a logbook in which he wrote the weather, the ships that "
    "passed, and the birds that rested on the gallery rail. When the light was automated in the "
    "spring of 1987, Elias packed the logbook into a tin box, locked the door behind him, and walked "
    "back along the spit to the village, where he lived for another twenty years without once "
    "returning to the tower. After his death the box was found under his bed, and the logbook inside "
    "it was given to the town museum, where it is still on display today."
)
SENTENCES = [s.strip() + "." for s in PASSAGE.split(".") if s.strip()]


def passages(n: int) -> list[str]:
    """n different passages: the sentences rotated, so requests in a batch do not share a prefix."""
    return [" ".join(SENTENCES[i % len(SENTENCES):] + SENTENCES[:i % len(SENTENCES)]) for i in range(n)]


def prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for text in passages(n):
        messages = [{"role": "user", "content": f"Copy the following passage exactly, word for word:\n\n{text}"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def spec_figures(llm) -> tuple[int, int]:
    spec = llm.engine.core.load().spec_decode
    return (spec.num_drafts, spec.num_accepted_tokens) if spec is not None else (0, 0)


def run(llm, batch: list[list[int]], max_tokens: int) -> dict:
    """Drive the engine step by step: decode time starts once every request has its first token."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    engine = llm.engine
    drafts0, accepted0 = spec_figures(llm)
    ids = [engine.add_request(f"bench-{time.monotonic_ns()}-{i}", {"prompt_token_ids": p}, params)
           for i, p in enumerate(batch)]
    tokens: dict[str, list[int]] = {}
    started: set[str] = set()
    t_decode = None
    done: set[str] = set()
    t0 = time.perf_counter()
    while len(done) < len(ids):
        for out in engine.step():
            if out.delta_token_ids:
                started.add(out.request_id)
            tokens[out.request_id] = out.outputs[0].token_ids
            if out.finished:
                done.add(out.request_id)
        if t_decode is None and len(started) == len(ids):
            t_decode = time.perf_counter()
            tokens_at_decode = sum(len(t) for t in tokens.values())
    t_end = time.perf_counter()
    total = sum(len(tokens[i]) for i in ids)
    drafts, accepted = spec_figures(llm)
    steps = drafts - drafts0
    return {
        "tokens": [tokens[i] for i in ids],
        "decode_tok_s": (total - tokens_at_decode) / (t_end - t_decode),
        "e2e_s": t_end - t0,
        "mean_acceptance_length": 1 + (accepted - accepted0) / steps if steps else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per engine and batch size")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's); a Ray engine replica gets 1")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args()
    if args.threads:
        import torch

        # NOTE: on a busy shared machine an OpenMP region waits until every one of its threads
        # gets a core; one thread per engine keeps a step from stalling on a neighbour's load.
        torch.set_num_threads(args.threads)

    from engine import LLM
    from engine.models.default_model import default_model

    model = args.model or default_model()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min}
    common = dict(max_num_seqs=max(args.batch_sizes), enable_prefix_caching=False)
    engines = {"plain": LLM(model, **common), "ngram": LLM(model, speculative_config=spec, **common)}
    tokenizer = engines["plain"].get_tokenizer()
    for llm in engines.values():  # warm-up: first-call allocations, not measured
        run(llm, prompts(tokenizer, 1), 8)

    results = {}
    for bs in args.batch_sizes:
        batch = prompts(tokenizer, bs)
        figures: dict[str, list[dict]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, llm in engines.items():  # alternate, so drift hits both alike
                figures[name].append(run(llm, batch, args.max_tokens))
        if figures["plain"][0]["tokens"] != figures["ngram"][0]["tokens"]:
            raise SystemExit(f"batch {bs}: greedy outputs differ with speculation")
        row = {name: statistics.median(r["decode_tok_s"] for r in runs) for name, runs in figures.items()}
        row["speedup"] = row["ngram"] / row["plain"]
        row["mean_acceptance_length"] = statistics.mean(r["mean_acceptance_length"] for r in figures["ngram"])
        row["output_tokens"] = sum(len(t) for t in figures["plain"][0]["tokens"])
        results[bs] = row
    if args.json:
        print(json.dumps({"model": model, "speculative_config": spec, "results": results}))
        return
    print(f"model {os.path.basename(model)}, n-gram k={args.k} lookup {args.prompt_lookup_min}..{args.prompt_lookup_max}, "
          f"greedy, max_tokens {args.max_tokens}, median of {args.repeats} alternating runs, "
          f"torch threads {torch_threads()}")
    print(f"{'batch':>5} {'plain tok/s':>12} {'ngram tok/s':>12} {'speedup':>8} {'accept len':>11} {'out tokens':>11}")
    for bs, r in results.items():
        print(f"{bs:>5} {r['plain']:>12.1f} {r['ngram']:>12.1f} {r['speedup']:>7.2f}x "
              f"{r['mean_acceptance_length']:>11.2f} {r['output_tokens']:>11}")


if __name__ == "__main__":
    main()
