"""Chained block hashes for prefix caching.

A block's hash covers its parent's hash, its own token ids and extra keys (the cache salt and
the LoRA adapter's name on the first block, so one adapter's KV never serves another; the hash of every image whose placeholders fall in the block), so equal hashes
imply equal full prefixes, not just equal blocks. Placeholder tokens are the same for every
image: without the image hash, two prompts with different images would share KV.
"""

from __future__ import annotations

import hashlib
from array import array

NONE_HASH: bytes = hashlib.sha256(b"pdserve/root-block").digest()


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: list[int] | tuple[int, ...], extra_keys: tuple = ()
) -> bytes:
    h = hashlib.sha256(parent_hash if parent_hash is not None else NONE_HASH)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def extend_block_hashes(
    block_hashes: list[bytes], token_ids: list[int], block_size: int, cache_salt: str | None,
    mm_features=None, lora_name: str | None = None,
) -> None:
    """Append the hashes of full blocks of `token_ids` not yet hashed (in place).
    `mm_features`: the request's MultiModalFeatures, or None. `lora_name`: its adapter's name
    (the name, not the engine-local id, so a P/D pair's two engines hash alike)."""
    start = len(block_hashes) * block_size
    while start + block_size <= len(token_ids):
        parent = block_hashes[-1] if block_hashes else None
        extra = ()
        if start == 0 and (cache_salt or lora_name):
            extra = (cache_salt,) if lora_name is None else (cache_salt, "lora", lora_name)
        if mm_features is not None:
            extra += mm_features.hashes_in(start, start + block_size)
        block_hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size], extra))
        start += block_size
