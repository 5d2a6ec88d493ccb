"""Tokens per second of grammar-constrained tool calls against plain chat, side by
side in one process on the offline engine, alternating which goes first (noisy machines).

Both sides run the same 8 chat requests, greedy. The plain side answers in text (`ignore_eos`,
max_tokens); the tool side has `tool_choice="required"` with parallel calls allowed, so its
output is the grammar's JSON array of calls, rendered the way the server renders it (the
model's template with the tools, or pdserve's tool system message where the template has no
tool support). Generated tokens over wall time, per side.

    python scripts/bench_tools.py                         # SmolLM2 (the default model)
    python scripts/bench_tools.py --model small --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCH = 8
CITIES = ["Paris", "Oslo", "Lima", "Tokyo", "Cairo", "Quito", "Hanoi", "Perth"]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
        "required": ["city"], "additionalProperties": False}}},
]


def _prompts(tokenizer, plan):
    from cluster.http.chat import render

    class _Body:  # what render reads of a chat request
        add_generation_prompt, continue_final_message = True, False

        def __init__(self, city):
            self.city = city

        def conversation(self):
            return [{"role": "user", "content": f"What is the weather in {self.city} for the next three days?"}]

    return [{"prompt_token_ids": render(tokenizer, _Body(c), None, plan)[1]} for c in CITIES[:BATCH]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="default (SmolLM2), a preset, or a model path")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    from cluster.http.tool_parsers import HermesToolParser
    from cluster.http.tools import ToolPlan
    from engine import LLM, SamplingParams
    from engine.models.default_model import default_model, ensure_preset_model

    model = default_model() if args.model == "default" else (
        ensure_preset_model(args.model) if args.model in ("tiny", "small", "bench") else args.model)
    llm = LLM(model, max_model_len=2048)
    tok = llm.get_tokenizer()
    plan = ToolPlan.of(TOOLS, "required", True, HermesToolParser, True)
    plain_prompts, tool_prompts = _prompts(tok, None), _prompts(tok, plan)
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    tools = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=plan.constraint())

    def run(prompts, params):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        return sum(len(o.outputs[0].token_ids) for o in outs) / dt, outs

    run(tool_prompts[:1], tools)  # warm-up: the grammar compiles once
    rates = {"plain": [], "tools": []}
    calls, lengths = None, {}
    for i in range(args.repeats):
        order = [("plain", plain_prompts, plain), ("tools", tool_prompts, tools)]
        for name, prompts, params in (order if i % 2 == 0 else order[::-1]):
            rate, outs = run(prompts, params)
            rates[name].append(rate)
            lengths[name] = statistics.mean(len(o.outputs[0].token_ids) for o in outs)
            if name == "tools":
                calls = [plan.parse(o.outputs[0].text)[1] for o in outs]
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {"model": args.model, "batch": BATCH, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "plain_tok_s": med["plain"], "tools_tok_s": med["tools"], "ratio": med["tools"] / med["plain"],
              "requests_with_valid_calls": sum(1 for c in calls if c),
              # Shorter outputs (a call ends the answer) and longer prompts (the tools) lower
              # tokens/s on their own, whatever the grammar costs.
              "mean_output_tokens": lengths,
              "prompt_tokens": {"plain": len(plain_prompts[0]["prompt_token_ids"]),
                                "tools": len(tool_prompts[0]["prompt_token_ids"])}}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
