"""The hybrid KV cache (engine.kv_cache.manager, engine.kv_cache.hybrid): a window group frees
a request's blocks once no query can see them, keeps prefix hits that its window can resume
from, and is sized so that it never runs out before the main group."""

from __future__ import annotations

import pytest

from engine.kv_cache import KVCacheManager
from engine.kv_cache.hybrid import KVGroups, kv_groups, split_blocks, window_blocks_bound
from engine.models.arch import arch_from_dict
from tests.engine.kv_factories import BLOCK_SIZE, make_request, tokens

W = 6  # window in tokens: straddles block boundaries (block size 4)


def _hybrid(num_blocks=32, num_window_blocks=16, caching=True, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, caching, window=W, num_window_blocks=num_window_blocks, **kw)


def _held(manager: KVCacheManager, rid: str, group: int) -> list[int]:
    g = manager.groups[group]
    return [b.block_id for b in g.req_blocks.get(rid, []) if b is not g.null]


def _run_chunks(manager, request, chunk: int, group: int = 1) -> list[int]:
    """Prefill in chunks as the scheduler does; the window group's blocks held after each."""
    held = []
    while request.num_computed_tokens < request.num_tokens:
        n = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert manager.allocate_slots(request, n) is not None
        request.num_computed_tokens += n
        held.append(len(_held(manager, request.request_id, group)))
    return held


def test_window_group_holds_only_the_blocks_a_query_can_still_see():
    manager = _hybrid()
    request = make_request("a", tokens(40))  # 10 blocks, the window is 6 tokens
    held = _run_chunks(manager, request, 4)
    # Before a 4-token chunk at position p, keys from p - 5 on are visible: at most 3 blocks
    # stay held (2 for the window across a boundary, 1 being written).
    assert max(held) <= 3 and len(held) == 10
    assert len(manager.req_to_blocks["a"]) == 10  # the full-attention group keeps everything
    window = manager.groups[1]
    blocks = window.req_blocks["a"]
    assert len(blocks) == 10 and blocks[0] is window.null  # one entry per block, nulls first
    # A decode step at position 40 frees what fell out of (34, 40].
    request.append_output_token(7)
    assert manager.allocate_slots(request, 1) is not None
    assert [b is window.null for b in blocks[:8]] == [True] * 8
    manager.free(request)
    assert window.pool.get_num_free_blocks() == window.pool.num_usable_blocks == 15
    assert manager.block_pool.get_num_free_blocks() == 32


def test_freed_window_blocks_stay_cached_and_a_later_prompt_resumes_from_its_window():
    manager = _hybrid()
    first = make_request("a", tokens(33))
    _run_chunks(manager, first, 8)
    manager.free(first)
    again = make_request("b", tokens(33))
    hit, n = manager.get_computed_blocks(again)
    # 8 full blocks cached in the main group; the window group resumes at block 8 with the
    # blocks covering (32 - 6, 32] cached: blocks 6 and 7, nulls before them.
    assert n == 32
    window = manager.groups[1]
    assert [b is window.null for b in hit.window_blocks] == [True] * 6 + [False] * 2
    assert manager.allocate_slots(again, 1, n, hit) is not None
    assert len(_held(manager, "b", 1)) == 3


def test_an_evicted_block_inside_the_window_shortens_the_hit():
    manager = _hybrid(num_window_blocks=12)
    first = make_request("a", tokens(33))
    _run_chunks(manager, first, 8)
    manager.free(first)
    window = manager.groups[1]
    # Evict window block 7 (positions 28..31): resuming at 32 needs it, resuming at 28 does not.
    seventh = window.pool.get_cached_block(first.block_hashes[7])
    window.pool.free_block_queue.remove(seventh)
    window.pool._evict_cached_block(seventh, [])
    window.pool.free_block_queue.append(seventh)
    hit, n = manager.get_computed_blocks(make_request("b", tokens(33)))
    assert n == 28 and len(hit.blocks) == 7 and len(hit.window_blocks) == 7


def test_a_full_window_pool_refuses_without_changing_anything():
    manager = _hybrid(num_window_blocks=4)  # 3 usable blocks
    a = make_request("a", tokens(12))
    assert manager.allocate_slots(a, 12) is not None  # blocks 0..2 all visible to the last query
    before = (manager.block_pool.get_num_free_blocks(), manager.groups[1].pool.get_num_free_blocks())
    assert manager.allocate_slots(make_request("b", tokens(8, 100)), 8) is None
    assert (manager.block_pool.get_num_free_blocks(), manager.groups[1].pool.get_num_free_blocks()) == before
    assert "b" not in manager.req_to_blocks and "b" not in manager.groups[1].req_blocks


def test_an_all_window_model_frees_in_its_one_group():
    manager = KVCacheManager(16, BLOCK_SIZE, True, main_window=W)
    assert manager.num_blocks == 15  # block 0 is the null placeholder
    request = make_request("a", tokens(40))
    assert max(_run_chunks(manager, request, 4, group=0)) <= 3
    manager.free(request)
    assert manager.get_num_free_blocks() == 15 and manager.reset_prefix_cache()


def test_groups_follow_the_layers():
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                vocab_size=128, sliding_window=8)
    gemma = arch_from_dict({**base, "architectures": ["Gemma2ForCausalLM"]})
    mistral = arch_from_dict({**base, "architectures": ["MistralForCausalLM"]})
    llama = arch_from_dict({**base, "architectures": ["LlamaForCausalLM"], "sliding_window": None})
    free = dict(disabled=False, draft_model=False)
    assert kv_groups(gemma, **free) == KVGroups(window=8, num_window_layers=2)
    assert kv_groups(mistral, **free) == KVGroups(main_window=8)
    assert kv_groups(llama, **free) == KVGroups()
    for off in (dict(free, disabled=True), dict(free, draft_model=True)):
        assert kv_groups(gemma, **off) == KVGroups()
    assert kv_groups(mistral, **dict(free, draft_model=True)) == KVGroups()


def test_window_pool_sizing():
    # 2 requests x (ceil((6 - 1) / 4) + 2 = 4 blocks) + one 16-token chunk (4 blocks) + null.
    assert window_blocks_bound(6, 4, 2, 16) == 13
    assert split_blocks(100, None, 10, 10, bound=13) == (100, 14)
    assert split_blocks(5, None, 10, 10, bound=13) == (5, 6)
    # Memory: even split while under the bound, else the bound and the rest to the main group.
    assert split_blocks(None, 10 * 20 + 10, 10, 10, bound=13) == (10, 11)
    main, window = split_blocks(None, 1000, 10, 10, bound=13)
    assert window == 14 and main == (1000 - 14 * 10) // 10


def test_a_window_group_needs_room():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        KVCacheManager(8, BLOCK_SIZE, window=W, num_window_blocks=1)
