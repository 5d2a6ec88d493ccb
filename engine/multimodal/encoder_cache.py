"""Scheduler-side bookkeeping of the encoder cache (vLLM's EncoderCacheManager;
docs/multimodal.md#scheduling-and-the-encoder-cache).

Capacity is counted in encoder output embeddings. An entry is referenced by the requests that
still need it; once no request does it becomes freeable but stays cached (a later request
with the same image is a hit) until space is needed, then the oldest freeable entry goes
first. Evicted hashes are handed to the model runner, which holds the tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class EncoderCacheStats:
    queries: int = 0  # items looked up
    hits: int = 0  # of which were cached


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        # mm_hash -> ids of requests that still need it (empty set: freeable).
        self.cached: dict[str, set[str]] = {}
        self.sizes: dict[str, int] = {}
        # Unreferenced entries in the order they became unreferenced (eviction order).
        self.freeable: OrderedDict[str, None] = OrderedDict()
        self.freed: list[str] = []
        self.stats = EncoderCacheStats()

    def lookup(self, request_id: str, mm_hash: str) -> bool:
        """Whether the output is cached; if so `request_id` now references it. Counted once
        per (request, item) by the caller, not per step."""
        refs = self.cached.get(mm_hash)
        if refs is None:
            return False
        if not refs:
            self.freeable.pop(mm_hash, None)
        refs.add(request_id)
        return True

    def can_allocate(self, size: int) -> bool:
        """Whether `size` embeddings fit, evicting freeable entries (oldest first) if needed."""
        if size > self.num_free_slots + sum(self.sizes[h] for h in self.freeable):
            return False
        while size > self.num_free_slots:
            mm_hash, _ = self.freeable.popitem(last=False)
            del self.cached[mm_hash]
            self.num_free_slots += self.sizes.pop(mm_hash)
            self.freed.append(mm_hash)
        return True

    def allocate(self, request_id: str, mm_hash: str, size: int) -> None:
        assert mm_hash not in self.cached and size <= self.num_free_slots
        self.cached[mm_hash] = {request_id}
        self.sizes[mm_hash] = size
        self.num_free_slots -= size

    def holds(self, request_id: str, mm_hash: str) -> bool:
        return request_id in self.cached.get(mm_hash, ())

    def release(self, request_id: str, mm_hash: str) -> None:
        """`request_id` no longer needs the entry (its KV holds what the embeddings gave)."""
        refs = self.cached.get(mm_hash)
        if refs is None or request_id not in refs:
            return
        refs.discard(request_id)
        if not refs:
            self.freeable[mm_hash] = None

    def release_all(self, request_id: str, mm_hashes) -> None:
        for mm_hash in mm_hashes:
            self.release(request_id, mm_hash)

    def take_freed(self) -> list[str]:
        """Hashes evicted since the last call: the runner drops their tensors."""
        freed, self.freed = self.freed, []
        return freed

    @property
    def num_referenced(self) -> int:
        return sum(1 for refs in self.cached.values() if refs)
