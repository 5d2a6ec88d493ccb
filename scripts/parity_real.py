"""Greedy parity with transformers at real size (docs/benchmarks.md#real-size-parity): the default model, SmolLM2-135M-
Instruct (Q4_1 GGUF), 256 tokens on 16 chat prompts, and the `bench` preset, 128 tokens on
random prompts. Too long for the test suite (minutes); tests/test_scripts.py runs its logic on
the tiny model.

pdserve generates greedily for all prompts in one batch, EOS ignored so every prompt gives the
same number of positions. SmolLM2 runs twice: with the product's defaults for a GGUF file (its
blocks kept, fp32 activations) and with quantization="none" (dequantized at load).
Transformers, in fp32 on the same file (its own GGUF reader and dequantization) or the same
safetensors, then reads each prompt plus pdserve's tokens in one pass (teacher forcing), so
every generated position is judged on its own and an early divergence hides nothing after it:
- exact: transformers' argmax is pdserve's token;
- near-tie: it is not, but pdserve's token scores within REL_MARGIN x the logit range (best
  less worst logit) at that position of transformers' best;
- mismatch: anything else; the script exits 1 when there is one.
Also per run: the identical prefix, the tokens before the first position where transformers'
argmax differs (the prefix HF `generate` would share with pdserve, up to the rounding of a
cached step against one pass; --hf-generate runs `generate` and compares); the largest
difference between pdserve's logprob of its token and transformers' (the numerical noise the
margin must cover); the wall time.

    python scripts/parity_real.py                        # SmolLM2 (both settings) and bench
    python scripts/parity_real.py --only smollm2 --hf-generate
    python scripts/parity_real.py --preset tiny --max-tokens 8 --num-prompts 2    # quick check
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

# Before torch loads OpenMP: spinning waiters lose two thirds of the work on a machine shared
# with other busy processes, passive ones about 1% alone (docs/benchmarks.md#openmp-wait-policy).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Relative to the logit range at the position (best less worst logit: about 42 on SmolLM2,
# 15 on the bench preset). Two correct fp32 implementations that sum in a different order
# (blocked Q4_1 dot products or oneDNN against torch's matmul) differ by under 1e-5 of it
# (measured: logprobs 2e-5 to 9e-5 apart), so 1e-3 leaves two orders of magnitude for
# rounding, while int8 activations, the nearest wrong computation we know for an fp32 path,
# swap tokens at gaps of 0.08 and 0.12 logits on SmolLM2 (tests/engine/test_gguf_smollm2.py),
# about 2e-3 of its range: a mismatch here.
REL_MARGIN = 1e-3
# Varied, realistic chat requests: facts, how-tos, code, maths, writing, advice, lists.
CHATS = [
    "What is the capital of Australia, and why isn't it Sydney?",
    "Explain how photosynthesis works in simple terms.",
    "Write a Python function that checks whether a string is a palindrome.",
    "I have a job interview tomorrow for a marketing role. How should I prepare?",
    "What are three tips for keeping houseplants alive in winter?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "If a train travels 120 km in 1.5 hours, what is its average speed?",
    "Write a short, friendly email asking my landlord to fix a leaking tap.",
    "What is the difference between a virus and a bacterium?",
    "Give me a recipe for a quick vegetarian dinner.",
    "How do I convert a list of strings to integers in JavaScript?",
    "Why is the sky blue?",
    "Suggest five names for a coffee shop near the beach.",
    "What should I pack for a three-day hiking trip?",
    "Explain what a neural network is to a ten-year-old.",
    "Write a haiku about autumn leaves.",
]
# Mixed lengths, so prefill chunks and decode share the batch's steps.
RANDOM_PROMPT_LENGTHS = (7, 23, 64, 130, 257, 511)


def chat_prompts(tokenizer, questions: list[str]) -> list[list[int]]:
    """Each question as a one-turn chat rendered by the model's own template."""
    out = []
    for q in questions:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # From 3: the special tokens sit at the bottom of the presets' vocabularies.
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def pdserve_greedy(llm, prompts, max_tokens: int) -> tuple[list[list[int]], list[list[float]], float]:
    """All prompts in one batch -> (tokens, pdserve's logprob of each token, seconds)."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[lp[t] for t, lp in zip(toks, o.outputs[0].logprobs)] for toks, o in zip(tokens, outs)]
    return tokens, logprobs, seconds


def judge(hf, prompts, generated, rel_margin: float = REL_MARGIN) -> dict:
    """Teacher-forced verdict on every generated position (see the module docstring), with
    transformers' logprob of each generated token."""
    v = {"positions": 0, "exact": 0, "near_tie": 0, "mismatch": 0, "identical_prefix": [],
         "worst_mismatch": [], "near_ties": [], "logprobs": [], "ranges": []}
    with torch.no_grad():
        for i, (p, g) in enumerate(zip(prompts, generated)):
            logits = hf(torch.tensor([p + g[:-1]])).logits[0, len(p) - 1:].float()  # [len(g), vocab]
            chosen = torch.tensor(g)
            best = logits.max(dim=-1)
            gap = best.values - logits.gather(1, chosen[:, None])[:, 0]
            spread = best.values - logits.min(dim=-1).values
            rel = gap / spread
            v["ranges"] += spread.tolist()
            same = best.indices == chosen
            wrong = (~same).nonzero()[:, 0].tolist()
            v["identical_prefix"].append(wrong[0] if wrong else len(g))
            v["positions"] += len(g)
            v["exact"] += int(same.sum())
            for j in wrong:
                entry = (round(rel[j].item(), 6), round(gap[j].item(), 4), i, j)
                if rel[j] <= rel_margin:
                    v["near_tie"] += 1
                    v["near_ties"].append(entry)
                else:
                    v["mismatch"] += 1
                    v["worst_mismatch"].append(entry)
            v["logprobs"].append(torch.log_softmax(logits, dim=-1).gather(1, chosen[:, None])[:, 0].tolist())
    v["worst_mismatch"] = sorted(v["worst_mismatch"], reverse=True)[:5]
    return v


def max_logprob_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, w in zip(a, b) for x, y in zip(u, w))


def hf_generate(hf, prompts, max_tokens: int) -> list[list[int]]:
    """HF `generate` itself, greedy, one prompt at a time (no padding), EOS ignored."""
    hf.generation_config.eos_token_id = None  # as pdserve's ignore_eos: keep going past EOS
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


def shared_prefix(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per prompt, how many leading tokens `a` and `b` share."""
    return [next((j for j, (x, y) in enumerate(zip(u, w)) if x != y), min(len(u), len(w))) for u, w in zip(a, b)]


def load_hf(model: str):
    from transformers import AutoModelForCausalLM

    from engine.models.gguf_file import hf_pretrained_args

    path, kwargs = hf_pretrained_args(model)  # a GGUF file: transformers' own GGUF reader
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


def run_model(name: str, model: str, settings: list[tuple[str, str | None]], prompts_of, max_tokens: int,
              hf_generate_too: bool) -> list[dict]:
    """pdserve under each (label, quantization) setting, then transformers on its tokens.
    `prompts_of(llm)` makes the prompts (a chat template needs the engine's tokenizer)."""
    from engine import LLM

    runs = []
    prompts = None
    for label, quantization in settings:
        llm = LLM(model, quantization=quantization, enable_prefix_caching=False, seed=0)
        prompts = prompts if prompts is not None else prompts_of(llm)
        tokens, logprobs, seconds = pdserve_greedy(llm, prompts, max_tokens)
        eos = set(llm.engine.eos_token_ids)
        llm.shutdown()
        del llm
        gc.collect()  # the engine's reference cycles hold its KV cache until collected
        runs.append({"model": name, "setting": label, "tokens": tokens, "logprobs": logprobs,
                     "pdserve_s": seconds, "prompts": len(prompts), "max_tokens": max_tokens,
                     "prompt_tokens": sum(map(len, prompts)),
                     "ended": sum(any(t in eos for t in g) for g in tokens)})
    t0 = time.perf_counter()
    hf = load_hf(model)
    hf_tokens = hf_generate(hf, prompts, max_tokens) if hf_generate_too else None
    for run in runs:
        # Settings that gave the same tokens share one teacher-forced pass.
        same = next((r for r in runs if "verdict" in r and r["tokens"] == run["tokens"]), None)
        run["verdict"] = same["verdict"] if same else judge(hf, prompts, run["tokens"])
        run["logprob_diff"] = max_logprob_diff(run["verdict"]["logprobs"], run["logprobs"])
        if hf_tokens is not None:
            run["hf_generate_prefix"] = shared_prefix(hf_tokens, run["tokens"])
    for run in runs:
        run["hf_s"] = time.perf_counter() - t0
    del hf
    gc.collect()
    return runs


def describe(run: dict) -> str:
    v = run["verdict"]
    prefix = v["identical_prefix"]
    lines = [
        f"{run['model']} [{run['setting']}]: {run['prompts']} prompts ({run['prompt_tokens']} prompt tokens) "
        f"x {run['max_tokens']} tokens; {run['ended']} answers emitted EOS before the end (ignored)",
        f"  positions {v['positions']}: exact {v['exact']}, near-ties {v['near_tie']} "
        f"(gap <= {REL_MARGIN:g} of the logit range, median {statistics.median(v['ranges']):.1f}), "
        f"mismatches {v['mismatch']}",
        f"  identical prefix (first divergence) per prompt: {prefix}; "
        f"{sum(n == run['max_tokens'] for n in prefix)}/{len(prefix)} identical throughout",
        f"  largest |pdserve - transformers| logprob of pdserve's token: {run['logprob_diff']:.2e}",
        f"  pdserve {run['pdserve_s']:.1f} s; transformers (load and every setting's teacher forcing"
        f"{', generate' if 'hf_generate_prefix' in run else ''}) {run['hf_s']:.1f} s",
    ]
    if v["near_ties"]:
        lines.append(f"  near-ties (relative gap, logit gap, prompt, position): {v['near_ties'][:8]}")
    if v["worst_mismatch"]:
        lines.append(f"  worst mismatches (relative gap, logit gap, prompt, position): {v['worst_mismatch']}")
    if "hf_generate_prefix" in run:
        agree = run["hf_generate_prefix"] == prefix
        lines.append(f"  HF generate: identical prefix {run['hf_generate_prefix']} "
                     f"({'the same as' if agree else 'DIFFERENT from'} teacher forcing's)")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("smollm2", "bench"), default=None,
                    help="run one of the two default checks (default: both)")
    ap.add_argument("--model", default=None,
                    help="instead of the default checks: this model dir or .gguf file on random prompts")
    ap.add_argument("--preset", default=None, choices=("tiny", "small", "bench", "1b"),
                    help="instead of the default checks: this preset (made on first use) on random prompts")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="tokens per prompt (default: 256 for SmolLM2, 128 otherwise)")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="prompts per model, 1-16: the first N chats, random prompts at most 6 "
                    "(default: all)")
    ap.add_argument("--hf-generate", action="store_true",
                    help="also run HF generate and compare its identical prefix with teacher forcing's")
    args = ap.parse_args(argv)
    if args.model and args.preset:
        ap.error("--model and --preset are exclusive")
    if (args.model or args.preset) and args.only:
        ap.error("--only picks a default check; it does not go with --model or --preset")
    for name in ("max_tokens", "num_prompts"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.num_prompts is not None and args.num_prompts > len(CHATS):
        ap.error(f"--num-prompts must be in [1, {len(CHATS)}], got {args.num_prompts}")
    return args


def plan(args) -> list[tuple]:
    """(name, model, settings, prompts_of, max_tokens) per model to check."""
    from engine.models.arch import load_arch
    from engine.models.default_model import default_model, ensure_preset_model
    from kernels.cpu import quant

    def random_of(model):
        vocab = load_arch(model).vocab_size
        return lambda llm: random_prompts(vocab, RANDOM_PROMPT_LENGTHS[:args.num_prompts])

    if args.model or args.preset:
        model = args.model or ensure_preset_model(args.preset)
        name = args.preset or os.path.basename(os.path.normpath(model))
        return [(name, model, [("default", None)], random_of(model), args.max_tokens or 128)]
    checks = []
    if args.only in (None, "smollm2"):
        questions = CHATS[:args.num_prompts]
        checks.append(("SmolLM2-135M-Instruct Q4_1", default_model(),
                       [(f"gguf blocks, {quant.ACTIVATIONS} activations (default)", None),
                        ("quantization=none", "none")],
                       lambda llm: chat_prompts(llm.get_tokenizer(), questions), args.max_tokens or 256))
    if args.only in (None, "bench"):
        model = ensure_preset_model("bench")
        checks.append(("bench preset", model, [("default", None)], random_of(model), args.max_tokens or 128))
    return checks


def main(argv=None) -> int:
    from kernels.cpu import quant

    args = parse_args(argv)
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY="
          f"{os.environ['OMP_WAIT_POLICY']}, PDSERVE_QUANT_ACTIVATIONS={quant.ACTIVATIONS}")
    if quant.ACTIVATIONS != "fp32":
        print("  (int8 activations: expect near-ties and mismatches; the default is fp32)")
    runs = []
    for name, model, settings, prompts_of, max_tokens in plan(args):
        for run in run_model(name, model, settings, prompts_of, max_tokens, args.hf_generate):
            print(describe(run), flush=True)
            runs.append(run)
    mismatches = sum(r["verdict"]["mismatch"] for r in runs)
    print(f"total: {sum(r['verdict']['positions'] for r in runs)} positions, {mismatches} mismatches; "
          f"wall {time.perf_counter() - t0:.0f} s, this process's CPU {time.process_time() - cpu0:.0f} s")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
