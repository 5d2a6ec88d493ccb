"""Where pdserve keeps what it derives once per machine (converted GGUF tokenizers, the
tokenizer classes AutoTokenizer picked, the benchmarks' preset models): $PDSERVE_CACHE, else
~/.cache/pdserve. kernels/cpu/build.py reads the same variable itself (the kernels package
sits below engine/ and imports nothing from it)."""

from __future__ import annotations

import os


def cache_root() -> str:
    return os.environ.get("PDSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pdserve"))
