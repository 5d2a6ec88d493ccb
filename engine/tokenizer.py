"""A model directory's tokenizer and EOS ids (HF files or a GGUF file)."""

from __future__ import annotations

import json
import os

from engine.models.gguf_file import find_gguf, gguf_eos_token_ids


def load_tokenizer(model_dir: str):
    gguf = find_gguf(model_dir)
    if gguf is not None:
        from engine.models.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(gguf)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def eos_token_ids(model_dir: str, tokenizer) -> list[int]:
    """EOS ids from the GGUF metadata, or generation_config.json, else config.json, else the
    tokenizer."""
    gguf = find_gguf(model_dir)
    if gguf is not None:
        return gguf_eos_token_ids(gguf)
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                return list(eos) if isinstance(eos, list) else [eos]
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
