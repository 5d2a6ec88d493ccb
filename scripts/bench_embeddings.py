"""Offline embedding throughput: pdserve's pooling engine (`LLM.embed`: continuous batching,
chunked prefill, no padding) against Hugging Face transformers' batched forward (right-padded
batches with an attention mask, pooled the same way), side by side in one process on the same
inputs, alternating which side goes first, since these machines are noisy. The two sides'
embeddings are compared too (the least cosine over the inputs), so a fast wrong answer shows.

    python scripts/bench_embeddings.py                          # the bench preset, 64 inputs of 1-512 tokens
    python scripts/bench_embeddings.py --model small --pooling MEAN --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _resolve(name: str) -> str:
    from engine.models.default_model import ensure_preset_model

    return ensure_preset_model(name) if name in ("tiny", "small", "bench", "1b") else name


def _inputs(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]


def hf_embed(model, prompts: list[list[int]], pooling: str, batch_size: int, pad_id: int):
    """transformers' batched forward: batches of `batch_size` in input order, right-padded."""
    import torch

    out = []
    with torch.inference_mode():
        for b in range(0, len(prompts), batch_size):
            batch = prompts[b:b + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, p in enumerate(batch):
                ids[i, :len(p)] = torch.tensor(p)
                mask[i, :len(p)] = 1
            h = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()  # [B, W, hidden]
            lengths = mask.sum(dim=1)
            if pooling == "MEAN":
                vec = (h * mask.unsqueeze(-1)).sum(dim=1) / lengths.unsqueeze(-1)
            elif pooling == "CLS":
                vec = h[:, 0]
            else:
                vec = h[torch.arange(len(batch)), lengths - 1]
            out.extend(torch.nn.functional.normalize(vec, dim=-1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench", help="a preset (tiny, small, bench, 1b) or a model directory")
    ap.add_argument("--num-inputs", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=1)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--pooling", default="LAST", choices=("LAST", "MEAN", "CLS"))
    ap.add_argument("--hf-batch-size", type=int, default=16, help="inputs per transformers forward")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    import torch
    from transformers import AutoModel

    from engine import LLM

    model_dir = _resolve(args.model)
    llm = LLM(model_dir, runner="pooling", pooler_config={"pooling_type": args.pooling, "normalize": True},
              max_model_len=max(args.max_len + 1, 16))
    vocab = llm.engine.processor.vocab_size
    pad_id = llm.get_tokenizer().pad_token_id or 0
    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = _inputs(args.num_inputs, args.min_len, args.max_len, vocab, args.seed)
    tokens = sum(len(p) for p in prompts)
    batch = [{"prompt_token_ids": p} for p in prompts]

    times = {"pdserve": [], "transformers": []}
    # CPU seconds of this process too: on a shared machine wall time moves with others' load,
    # the CPU time a side spends moves much less (both sides run in this process).
    cpu = {"pdserve": [], "transformers": []}
    results = {}
    sides = {"pdserve": lambda: [o.outputs.embedding for o in llm.embed(batch, use_tqdm=False)],
             "transformers": lambda: hf_embed(hf, prompts, args.pooling, args.hf_batch_size, pad_id)}
    for r in range(args.repeats):
        for name in (("pdserve", "transformers") if r % 2 == 0 else ("transformers", "pdserve")):
            t0, c0 = time.perf_counter(), time.process_time()
            results[name] = sides[name]()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    least_cos = min(torch.nn.functional.cosine_similarity(torch.tensor(a), b.float(), dim=0).item()
                    for a, b in zip(results["pdserve"], results["transformers"]))
    report = {"model": model_dir, "inputs": len(prompts), "prompt_tokens": tokens, "pooling": args.pooling,
              "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg(),
              "least_cosine": least_cos, "sides": {}}
    for name, ts in times.items():
        best, med = min(ts), statistics.median(ts)
        report["sides"][name] = {"best_s": best, "median_s": med, "inputs_per_s": len(prompts) / best,
                                 "tokens_per_s": tokens / best, "best_cpu_s": min(cpu[name])}
        print(f"{name:13s} best {best:7.3f} s  median {med:7.3f} s  {len(prompts) / best:8.1f} inputs/s  "
              f"{tokens / best:9.0f} tokens/s  best CPU {min(cpu[name]):7.3f} s")
    sides = report["sides"]
    speedup = sides["transformers"]["best_s"] / sides["pdserve"]["best_s"]
    report["speedup"] = speedup
    report["cpu_speedup"] = sides["transformers"]["best_cpu_s"] / sides["pdserve"]["best_cpu_s"]
    print(f"pdserve / transformers: {speedup:.2f}x wall, {report['cpu_speedup']:.2f}x CPU time ({len(prompts)} "
          f"inputs, {tokens} tokens, least cosine {least_cos:.6f}, load average {os.getloadavg()[0]:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
