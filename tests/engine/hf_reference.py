"""Hugging Face `transformers` as the greedy-parity oracle."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    from engine.models.gguf_file import hf_pretrained_args

    # A GGUF checkpoint loads through transformers' own GGUF reader (its dequantization and
    # q/k un-permutation), independent of ours.
    path, kwargs = hf_pretrained_args(model_dir)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt, run one at a time (no padding), stopping at the
    model's EOS like `generate` does."""
    model = _hf_model(model_dir)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=max_new_tokens, do_sample=False,
            )
            outs.append(ids[0, len(p):].tolist())
    return outs


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Skip the special tokens at the bottom of the vocabulary.
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_mismatches(model_dir: str, prompts: list[list[int]], generated: list[list[int]], margin: float) -> int:
    """Teacher forcing: transformers reads each prompt plus the engine's tokens in one pass and
    judges every generated position on its own. A position is a mismatch when the engine's
    token scores more than `margin` (in logits) below transformers' best there; within the
    margin it is a near-tie that rounding between two correct implementations explains (int8
    activations, as llama.cpp quantizes them). Returns the number of mismatches."""
    return sum(gap > margin for gap in hf_gaps(model_dir, prompts, generated))


def hf_gaps(model_dir: str, prompts: list[list[int]], generated: list[list[int]]) -> list[float]:
    """Per generated position (teacher forcing, as hf_mismatches): transformers' best logit
    less the logit of the engine's token (0 where they agree)."""
    model = _hf_model(model_dir)
    gaps: list[float] = []
    with torch.no_grad():
        for p, g in zip(prompts, generated):
            if not g:
                continue
            logits = model(torch.tensor([p + g[:-1]])).logits[0, len(p) - 1:]  # [len(g), vocab]
            chosen = logits.gather(1, torch.tensor(g)[:, None])[:, 0]
            gaps += (logits.max(dim=1).values - chosen).tolist()
    return gaps
