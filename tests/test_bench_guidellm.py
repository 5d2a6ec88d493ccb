"""scripts/bench_guidellm.py's hand-over to guidellm: the tokenizer directory it gives guidellm
for the default model (a GGUF file) tokenizes like the file itself (oracle: transformers'
tokenizer built from the GGUF)."""

from __future__ import annotations

import os

from scripts.bench_guidellm import tokenizer_dir


def test_a_gguf_models_tokenizer_is_saved_where_guidellm_can_load_it():
    from transformers import AutoTokenizer

    from engine.models.default_model import default_model

    gguf = default_model()
    saved = tokenizer_dir(gguf)
    assert saved != gguf and os.path.isdir(saved)
    text = "The capital of France is Paris. Ünïcödé, emoji 🙂 and   spaces."
    oracle = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    assert AutoTokenizer.from_pretrained(saved)(text)["input_ids"] == oracle(text)["input_ids"]


def test_a_model_directory_is_its_own_tokenizer_dir(tiny_model):
    assert tokenizer_dir(tiny_model) == tiny_model
