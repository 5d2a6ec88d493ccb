"""Multi-LoRA throughput: the base model against four adapters mixed in every batch, on the
same requests, side by side in one process (these machines are noisy).

Three engines on the same model and requests: `base` (enable_lora off), `lora-off` (enable_lora
on, every request on the base model: the cost of having slots) and `mixed` (max_loras=4, the
requests spread round-robin over four adapters of ranks 8 and 16, attention-only and
every projection, so every step holds all four). Runs alternate --repeats times; the ratio of
the best runs and of the medians is printed.

    python scripts/bench_lora.py                  # CPU, the bench preset (made on first use)
    python scripts/bench_lora.py --preset tiny --num-requests 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_throughput import make_requests  # noqa: E402

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTENTION + ["gate_proj", "up_proj", "down_proj"]


def write_adapter(out: str, arch, r: int, modules: list[str], seed: int) -> str:
    """A PEFT-format adapter (adapter_config.json + adapter_model.safetensors) with random A and
    B, written directly so the benchmark needs no PEFT install."""
    from safetensors.torch import save_file

    from engine.lora.peft import projection_slices

    g = torch.Generator().manual_seed(seed)
    targets = projection_slices(arch)
    tensors = {}
    for layer in range(arch.num_layers):
        for m in modules:
            part = "self_attn" if m in ATTENTION else "mlp"
            t = targets[m]
            key = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, t.in_features, generator=g) / t.in_features ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(t.out_len, r, generator=g) * 0.01
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": modules}, f)
    return out


def runner(model: str, reqs, loras, **engine_kwargs):
    from engine import LLM, SamplingParams

    llm = LLM(model, enable_prefix_caching=False, max_num_seqs=len(reqs), **engine_kwargs)
    warm = loras[0] if loras else None
    llm.generate([{"prompt_token_ids": reqs[0][0]}], SamplingParams(max_tokens=4), lora_request=warm, use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    per_request = [loras[i % len(loras)] for i in range(len(reqs))] if loras else None

    def run() -> tuple[float, int]:
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, lora_request=per_request,
                            use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from engine.lora import LoRARequest
    from engine.models.arch import load_arch
    from engine.models.default_model import ensure_preset_model

    model = args.model or ensure_preset_model(args.preset)
    arch = load_arch(model)
    reqs = make_requests(args.num_requests, min(arch.vocab_size, 1400), 0, (32, 128), (32, 64))
    tmp = tempfile.mkdtemp(prefix="bench-lora-")
    shapes = [(8, ATTENTION), (16, ALL), (16, ATTENTION), (8, ALL)]
    loras = [LoRARequest(f"a{i}", i + 1, write_adapter(os.path.join(tmp, f"a{i}"), arch, r, mods, i))
             for i, (r, mods) in enumerate(shapes)]
    print(f"model={model} layers={arch.num_layers} hidden={arch.hidden_size} requests={len(reqs)} "
          f"adapters={[(lr.lora_name, r, len(m)) for lr, (r, m) in zip(loras, shapes)]} threads={torch.get_num_threads()}")
    runs = {
        "base": runner(model, reqs, None),
        "lora-off": runner(model, reqs, None, enable_lora=True, max_loras=4, max_lora_rank=16),
        "mixed": runner(model, reqs, loras, enable_lora=True, max_loras=4, max_lora_rank=16),
    }
    rates: dict[str, list[float]] = {k: [] for k in runs}
    for rep in range(args.repeats):
        for name, run in runs.items():
            seconds, tokens = run()
            rates[name].append(tokens / seconds)
            print(f"repeat {rep} {name:9s} {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s")
    for name in ("lora-off", "mixed"):
        best = max(rates[name]) / max(rates["base"])
        median = statistics.median(rates[name]) / statistics.median(rates["base"])
        print(f"{name} / base: best {best:.2f}x, median {median:.2f}x")


if __name__ == "__main__":
    main()
