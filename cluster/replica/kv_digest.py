"""A replica's cached prefix blocks as its routing stats carry them (docs/kv_cache.md#kv-aware-routing).

Serve hands every router the latest stats of each replica and may skip some in between, so
the stats carry the whole list (not the events since the last one): compact keys of the block
hashes per medium (engine.kv_cache.prefix_index.pack, 8 bytes each), the newest
MAX_ROUTED_KEYS per medium, and the engine's event count, by which a router knows whether to
rebuild its entry. Packed again only when that count moved.
"""

from __future__ import annotations

from engine.kv_cache.events import MEDIA, KVSnapshot
from engine.kv_cache.prefix_index import pack

# 64 Ki blocks of 16 tokens is a million tokens of prefix per medium: 512 KiB of keys.
MAX_ROUTED_KEYS = 1 << 16


class KVDigest:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._packed: dict | None = None
        self.counts: dict[str, int] = {}

    def of(self, snapshot: KVSnapshot | None) -> dict | None:
        if snapshot is None:
            return None
        if self._packed is None or self._packed["seq"] != snapshot.seq:
            held = {m: snapshot.held.get(m, ()) for m in MEDIA}
            self.counts = {m: len(hashes) for m, hashes in held.items()}
            self._packed = {"seq": snapshot.seq, "block_size": self.block_size,
                            **{m: pack(hashes[-MAX_ROUTED_KEYS:]) for m, hashes in held.items()}}
        return self._packed
