"""EncoderCacheManager and the scheduler's encoder planning, without a model."""

from __future__ import annotations

import torch

from engine.multimodal.encoder_cache import EncoderCacheManager
from engine.multimodal.features import MultiModalFeatures, MultiModalItem
from engine.multimodal.sched_encoder import (
    commit_encoder_inputs,
    plan_encoder_inputs,
    release_computed,
)
from engine.request import Request
from engine.sampling_params import SamplingParams


def _request(rid: str, items: list[tuple[str, int]], length: int = 16, prompt_len: int = 100) -> Request:
    pixels = torch.zeros(3, 4, 4)
    features = MultiModalFeatures(tuple(MultiModalItem("image", h, off, length, pixels) for h, off in items))
    return Request(rid, [0] * prompt_len, SamplingParams(), max_tokens=4, mm_features=features)


def test_unreferenced_entries_stay_cached_until_space_is_needed_oldest_first():
    cache = EncoderCacheManager(32)
    for rid, h in (("a", "x"), ("b", "y")):
        assert cache.can_allocate(16)
        cache.allocate(rid, h, 16)
    cache.release("a", "x")
    cache.release("b", "y")
    assert cache.lookup("c", "y")  # freeable, still a hit
    assert cache.can_allocate(16)  # evicts x, the oldest unreferenced one
    assert cache.take_freed() == ["x"]
    assert not cache.can_allocate(32)  # y is referenced by c: never evicted


def test_plan_stops_the_chunk_before_an_image_that_exceeds_the_budget():
    cache = EncoderCacheManager(64)
    request = _request("r", [("x", 10), ("y", 30)])
    plan = plan_encoder_inputs(cache, request, start=0, num_new_tokens=50, budget=16)
    assert plan.misses == [0]
    assert plan.num_new_tokens == 30  # up to y's first placeholder: y is never split


def test_plan_hits_an_image_another_request_encoded():
    cache = EncoderCacheManager(64)
    first, second = _request("a", [("x", 4)]), _request("b", [("x", 8)])
    to_encode: dict = {}
    commit_encoder_inputs(cache, first, plan_encoder_inputs(cache, first, 0, 30, 16), to_encode)
    plan = plan_encoder_inputs(cache, second, 0, 30, 0)  # no budget needed for a hit
    assert plan.hits == [0] and plan.num_new_tokens == 30
    commit_encoder_inputs(cache, second, plan, to_encode)
    assert list(to_encode) == ["x"]
    assert (cache.stats.queries, cache.stats.hits) == (2, 1)


def test_references_drop_once_the_placeholders_are_computed():
    cache = EncoderCacheManager(16)
    request = _request("r", [("x", 4)])
    commit_encoder_inputs(cache, request, plan_encoder_inputs(cache, request, 0, 10, 16), {})
    request.num_computed_tokens = 10  # mid-image: still needed
    release_computed(cache, request)
    assert cache.num_referenced == 1
    request.num_computed_tokens = 20
    release_computed(cache, request)
    assert cache.num_referenced == 0 and "x" in cache.cached


def test_a_full_cache_of_referenced_images_defers_the_chunk():
    cache = EncoderCacheManager(16)
    holder, waiter = _request("a", [("x", 0)]), _request("b", [("y", 5)])
    commit_encoder_inputs(cache, holder, plan_encoder_inputs(cache, holder, 0, 8, 16), {})
    plan = plan_encoder_inputs(cache, waiter, 0, 30, 16)
    assert plan.misses == [] and plan.num_new_tokens == 5
