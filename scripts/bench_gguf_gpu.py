"""GGUF blocks kept on a GPU (Triton gguf_matmul, PDSERVE_GGUF_TRITON=1) against the same file
dequantized to bf16 at load, side by side in one process: decode step time with CUDA graphs at
batch 1 and 16, weight bytes per step, and greedy agreement of the two paths. What decides
whether a GPU keeps GGUF blocks by default (engine/models/quant_linear.py). Needs CUDA.

The file is a Q4_K_M-like mix (Q4_K, with attn_v, ffn_down and the output head in Q6_K and the
embedding in Q8_0) of random weights in the `1b` preset's shapes (hidden 2048, MLP 5632,
vocabulary 32000) with --layers layers: the per-layer ratio is what is measured, and a short
stack keeps the file quick to write on the GPU machine.

    python scripts/bench_gguf_gpu.py [--layers 4] [--out /tmp/gguf-gpu] [--steps 32]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIX = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
       "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q8_0", "output": "Q6_K"}


def make_file(out: str, layers: int) -> str:
    from engine.models.make_model import make_model
    from tests.engine.gguf_factory import write_gguf

    path = os.path.join(out, f"1b-{layers}l-mix.gguf")
    if os.path.exists(path):
        return path
    hf = os.path.join(out, f"1b-{layers}l")
    if not os.path.exists(os.path.join(hf, "config.json")):
        make_model(hf, "1b", "llama", num_hidden_layers=layers, tie_word_embeddings=False)
    write_gguf(hf, path + ".tmp", "Q4_K", types=MIX, general_name="random 1b-shaped")
    os.replace(path + ".tmp", path)
    return path


def _engine(path: str, kept: bool, batch: int):
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from engine.models import quant_linear

    quant_linear.TRITON_GGUF = kept  # read when the loader plans which weights stay blocks
    return LLMEngine(EngineArgs(path, enable_prefix_caching=False, max_num_seqs=max(batch, 4),
                                quantization=None if kept else "none", max_model_len=1024).create_engine_config())


def _weight_bytes(model) -> tuple[int, int]:
    """(bytes of kept blocks, bytes of dense parameters) the model holds."""
    from engine.models.quant_linear import QuantWeight

    blocks = sum(q.nbytes for m in model.modules() for q in vars(m).values() if isinstance(q, QuantWeight))
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    return blocks, dense


def decode_step_ms(eng, batch: int, steps: int, vocab: int) -> float:
    from engine import SamplingParams

    rng = random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"d{batch}-{i}", {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(128)]}, params)
    for _ in range(4):  # the prefill, then graph capture and warm-up
        eng.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / steps * 1e3
    while eng.has_unfinished_requests():
        eng.step()
    return ms


def greedy(eng, prompts: list[list[int]]) -> list[list[int]]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"g{i}", {"prompt_token_ids": p}, params)
    done: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[f"g{i}"] for i in range(len(prompts))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default="/tmp/gguf-gpu")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gguf_gpu.py needs a CUDA GPU")
    t0 = time.perf_counter()
    path = make_file(args.out, args.layers)
    print(f"file {path}: {os.path.getsize(path) / 2**20:.0f} MiB, made in {time.perf_counter() - t0:.0f} s")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1400) for _ in range(n)] for n in (5, 40, 130, 300)]
    answers = {}
    for kept in (True, False):
        label = "kept blocks (Triton)" if kept else "dequantized bf16"
        eng = _engine(path, kept, max(args.batches))
        model = eng.core.executor.worker.runner.model
        blocks, dense = _weight_bytes(model)
        answers[kept] = greedy(eng, prompts)
        for batch in args.batches:
            ms = decode_step_ms(eng, batch, args.steps, 1400)
            print(f"{label:<22} batch {batch:>3}: step {ms:.3f} ms, {batch / ms * 1e3:8.1f} tok/s; "
                  f"weights {blocks / 2**20:.0f} MiB blocks + {dense / 2**20:.0f} MiB dense")
        del model, eng
        gc.collect()
        torch.cuda.empty_cache()
    same = sum(a == b for x, y in zip(answers[True], answers[False]) for a, b in zip(x, y))
    total = sum(len(x) for x in answers[True])
    print(f"greedy agreement, kept vs dequantized: {same}/{total} positions")


if __name__ == "__main__":
    main()
