"""PEFT as the LoRA oracle: adapters made with PEFT itself (random A and B, so they change
the output), and greedy generation through PeftModel."""

from __future__ import annotations

import functools

import torch


def make_peft_adapter(base_dir: str, out_dir: str, r: int, target_modules: list[str], alpha: int = 16,
                      use_rslora: bool = False, seed: int = 0, scale: float = 1.0) -> str:
    """Save a LoRA adapter of the model in `base_dir` with PEFT's own save_pretrained.
    `scale` multiplies B so the adapter moves greedy outputs without swamping the model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules, use_rslora=use_rslora,
                     init_lora_weights=False, lora_dropout=0.0, task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    model.save_pretrained(out_dir)
    return out_dir


@functools.lru_cache(maxsize=8)
def _peft_model(base_dir: str, adapter_dir: str | None):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return base
    from peft import PeftModel

    return PeftModel.from_pretrained(base, adapter_dir).eval()


def peft_greedy(base_dir: str, adapter_dir: str | None, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations through PEFT (the base model when adapter_dir is None), one prompt
    at a time, stopping at EOS as `generate` does."""
    model = _peft_model(base_dir, adapter_dir)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False)
            outs.append(ids[0, len(p):].tolist())
    return outs
