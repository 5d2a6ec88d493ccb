"""The scheduler's encoder step (docs/multimodal.md#scheduling-and-the-encoder-cache): which images to encode for the tokens a request
prefills this step, within the per-step encoder budget and the encoder cache.

Planning is pure (the scheduler may still fail to allocate KV and drop the request); commit
takes the cache references once the request is really scheduled. An image is encoded whole
or not at all: when it does not fit, the request's chunk stops just before its placeholders.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.multimodal.encoder_cache import EncoderCacheManager
from engine.request import Request


@dataclass
class EncoderPlan:
    num_new_tokens: int
    hits: list[int] = field(default_factory=list)  # items found in the cache (or planned earlier)
    misses: list[int] = field(default_factory=list)  # items to encode this step
    cost: int = 0  # embeddings encoded
    # The next image has no pixels (a P/D decode side that must recompute the prompt): it
    # can never run here.
    missing_pixels: bool = False


def plan_encoder_inputs(cache: EncoderCacheManager, request: Request, start: int, num_new_tokens: int,
                        budget: int) -> EncoderPlan:
    """Items overlapping tokens [start, start + num_new_tokens), and how many tokens can run."""
    plan = EncoderPlan(num_new_tokens)
    items = request.mm_features.items
    hit_hashes = {item.mm_hash for item in items if cache.holds(request.request_id, item.mm_hash)}
    planned: set[str] = set()
    for i, item in enumerate(items):
        if item.offset >= start + plan.num_new_tokens:
            break
        if item.end <= start or cache.holds(request.request_id, item.mm_hash):
            continue  # its KV is computed, or an earlier chunk of this request encoded it
        if item.mm_hash in planned or item.mm_hash in cache.cached:
            plan.hits.append(i)
            hit_hashes.add(item.mm_hash)
            continue
        room = cache.num_free_slots + sum(cache.sizes[h] for h in cache.freeable if h not in hit_hashes)
        plan.missing_pixels = item.pixel_values is None
        if plan.missing_pixels or plan.cost + item.length > min(budget, room):
            # Not this step: prefill up to the image; it runs whole in a later step. (No pixels:
            # a P/D decode side, which never encodes; the scheduler fails such a request.)
            plan.num_new_tokens = item.offset - start
            break
        plan.misses.append(i)
        plan.cost += item.length
        planned.add(item.mm_hash)
    return plan


def commit_encoder_inputs(cache: EncoderCacheManager, request: Request, plan: EncoderPlan,
                          to_encode: dict) -> None:
    """Reference the hits, allocate the misses (evicting unreferenced entries, oldest first)
    and add the misses' pixels to `to_encode` (mm_hash -> [3, H, W])."""
    items = request.mm_features.items
    rid = request.request_id
    # Reference the cached hits first, so evictions for the misses cannot take them.
    pending = []
    for i in sorted(plan.hits + plan.misses):
        cache.stats.queries += 1
        if cache.lookup(rid, items[i].mm_hash):
            cache.stats.hits += 1
        else:
            pending.append(i)
    for i in pending:  # misses, and repeats of a miss earlier in this prompt
        item = items[i]
        if cache.lookup(rid, item.mm_hash):
            cache.stats.hits += 1
            continue
        fits = cache.can_allocate(item.length)
        assert fits, "planned allocation no longer fits"
        cache.allocate(rid, item.mm_hash, item.length)
        to_encode[item.mm_hash] = item.pixel_values


def release_computed(cache: EncoderCacheManager, request: Request) -> None:
    """Drop the request's references to images whose placeholders are all computed: their
    embeddings live on in the KV cache. A hash repeated later in the prompt stays held."""
    done = request.num_computed_tokens
    items = request.mm_features.items
    still_needed = {item.mm_hash for item in items if item.end > done}
    for item in items:
        if item.end <= done and item.mm_hash not in still_needed:
            cache.release(request.request_id, item.mm_hash)


def release_all(cache: EncoderCacheManager, request: Request) -> None:
    for item in request.mm_features.items:
        cache.release(request.request_id, item.mm_hash)
