"""Where pdserve keeps what it derives once per machine (converted GGUF tokenizers, the
tokenizer classes AutoTokenizer picked): $PDSERVE_CACHE, else ~/.cache/pdserve."""

from __future__ import annotations

import os


def cache_root() -> str:
    return os.environ.get("PDSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pdserve"))
