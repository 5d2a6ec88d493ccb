"""A model directory's tokenizer and EOS ids (HF files or a GGUF file)."""

from __future__ import annotations

import json
import logging
import os
import pickle

from engine.models.gguf_file import find_gguf, gguf_eos_token_ids


def load_tokenizer(model_dir: str):
    gguf = find_gguf(model_dir)
    if gguf is not None:
        from engine.models.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(gguf)
    from engine.tokenizer_class import load_hf_tokenizer

    return load_hf_tokenizer(model_dir)


def pickled_tokenizer(tokenizer) -> bytes | None:
    """The front end's tokenizer for its engine cores (EngineCore.give_tokenizer): a core in
    another process that loads it again pays transformers' AutoTokenizer, whose model-config
    imports alone cost 1.7-2.4 CPU-s in a fresh process; unpickling the front end's costs
    about 0.02 s. None when it does not pickle (each core then loads its own)."""
    try:
        return pickle.dumps(tokenizer)
    except Exception:  # noqa: BLE001 - any tokenizer a user brings; the core can load its own
        logging.getLogger(__name__).debug("the tokenizer does not pickle; each core loads its own", exc_info=True)
        return None


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
