"""The tokenizer (and chat template) a GGUF file carries, through transformers' GGUF support.

Building a fast tokenizer from a GGUF vocabulary takes seconds (SmolLM2's 49k tokens and
merges: ~5 s idle, 3x that on a busy machine), and every engine replica and ingress of an app
needs it. The first build is therefore saved as an ordinary tokenizer directory under the
pdserve cache and later loads read that (~0.2 s). The cache key covers the file's path,
size and mtime and the transformers version that converted it, so a changed file or
converter never reuses a stale entry.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile

from engine.cache_dir import cache_root

logger = logging.getLogger(__name__)


def _cache_dir(path: str) -> str:
    import transformers

    st = os.stat(path)
    key = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return os.path.join(cache_root(), "gguf-tokenizers", hashlib.sha256(key.encode()).hexdigest()[:24])


def load_gguf_tokenizer(path: str):
    from transformers import AutoTokenizer

    from engine.tokenizer_class import load_hf_tokenizer

    cached = _cache_dir(path)
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        return load_hf_tokenizer(cached)
    from engine.models.gguf_file import metadata

    # transformers wraps a Gemma file's vocabulary in GemmaTokenizer, which adds a `<mask>`
    # token when the vocabulary has none: an id past the embedding, which the model (and the
    # structured-output grammar over its logits) does not have. A causal LM masks nothing.
    extra = {"mask_token": None} if metadata(path, "general.architecture", "").startswith("gemma") else {}
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                              gguf_file=os.path.basename(path), **extra)
    _save(tokenizer, cached)
    return tokenizer


def gguf_tokenizer_dir(path: str) -> str:
    """The cached tokenizer directory of a GGUF file, converted now if need be: for tools that
    load a tokenizer by directory (a load generator, say)."""
    load_gguf_tokenizer(path)
    cached = _cache_dir(path)
    if not os.path.isfile(os.path.join(cached, "tokenizer.json")):
        raise OSError(f"could not cache the tokenizer of {path} in {cached}")
    return cached


def _save(tokenizer, cached: str) -> None:
    """Write to a private directory, then rename: concurrent replicas converting the same
    file never see a half-written entry, and the first rename wins."""
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cached))
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, cached)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:  # a read-only home only costs the conversion next time
        logger.warning("could not cache the GGUF tokenizer in %s: %s", cached, e)
