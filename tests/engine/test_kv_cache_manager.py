"""Specification of KVCacheManager: per-request block allocation, prefix caching (hits, lazy
eviction, LRU eviction, cache salt), atomic allocation failure, decode growth, reset and stats.

All tests use block_size 4 unless stated otherwise.
"""

from __future__ import annotations

import pytest

from engine.kv_cache import KVCacheBlocks
from tests.engine.kv_factories import (
    BLOCK_SIZE,
    cached_block_ids,
    decode_step,
    free_block_ids,
    make_manager,
    make_request,
    prefill,
    ref_counts,
    request_blocks,
    tokens,
)


def index_snapshot(manager) -> dict[bytes, int]:
    return {h: b.block_id for h, b in manager.block_pool.cached_block_hash_to_block.items()}


def state_snapshot(manager):
    """Everything a failed allocation must leave untouched."""
    return (
        ref_counts(manager),
        manager.get_num_free_blocks(),
        free_block_ids(manager),
        {rid: [b.block_id for b in bs] for rid, bs in manager.req_to_blocks.items()},
        dict(manager.num_cached_blocks),
        index_snapshot(manager),
        [b.block_hash for b in manager.block_pool.blocks],
    )


# ---------------------------------------------------------------------------------------------
# Prefill allocation
# ---------------------------------------------------------------------------------------------


def test_prefill_allocates_enough_blocks_for_every_prompt_token():
    manager = make_manager(num_blocks=8)
    req = make_request("a", tokens(10))
    new = manager.allocate_slots(req, 10)
    assert len(new) == 3  # ceil(10 / 4)
    assert manager.get_num_free_blocks() == 5


def test_prefill_returns_the_newly_allocated_blocks_from_the_free_queue_head():
    manager = make_manager(num_blocks=8)
    req = make_request("a", tokens(10))
    new = manager.allocate_slots(req, 10)
    assert isinstance(new, KVCacheBlocks)
    assert new.get_block_ids() == [0, 1, 2]
    assert manager.get_block_ids("a") == [0, 1, 2]


def test_prefill_blocks_have_ref_cnt_1():
    manager = make_manager(num_blocks=8)
    req = make_request("a", tokens(10))
    prefill(manager, req)
    assert [b.ref_cnt for b in request_blocks(manager, req)] == [1, 1, 1]


def test_prefill_full_blocks_are_hashed_and_in_the_cache_index():
    manager = make_manager(num_blocks=8)
    req = make_request("a", tokens(10))
    prefill(manager, req)
    blocks = request_blocks(manager, req)
    assert [b.block_hash for b in blocks[:2]] == req.block_hashes
    for block, block_hash in zip(blocks[:2], req.block_hashes):
        assert manager.block_pool.cached_block_hash_to_block[block_hash] is block


def test_prefill_partial_last_block_has_no_hash():
    manager = make_manager(num_blocks=8)
    req = make_request("a", tokens(10))
    prefill(manager, req)
    last = request_blocks(manager, req)[-1]
    assert last.block_hash is None
    assert last.block_id not in cached_block_ids(manager)
    assert len(req.block_hashes) == 2


def test_prompt_of_exact_block_multiple_caches_every_block():
    manager = make_manager(num_blocks=8)
    req = make_request("a", tokens(8))
    prefill(manager, req)
    assert cached_block_ids(manager) == {0, 1}


def test_first_request_gets_no_prefix_hit():
    manager = make_manager(num_blocks=8)
    req = make_request("a", tokens(10))
    hit, num_hit_tokens = manager.get_computed_blocks(req)
    assert len(hit) == 0
    assert num_hit_tokens == 0


def test_usage_reflects_blocks_held_by_requests():
    manager = make_manager(num_blocks=8)
    prefill(manager, make_request("a", tokens(10)))
    assert manager.usage == pytest.approx(3 / 8)


# ---------------------------------------------------------------------------------------------
# Prefix hits
# ---------------------------------------------------------------------------------------------


def test_second_request_hits_the_full_blocks_of_a_shared_prefix():
    manager = make_manager(num_blocks=8)
    a = make_request("a", tokens(10))
    prefill(manager, a)
    b = make_request("b", tokens(8) + [500, 501, 502])
    hit, num_hit_tokens = manager.get_computed_blocks(b)
    assert hit.get_block_ids() == manager.get_block_ids("a")[:2]
    assert num_hit_tokens == 8


def test_hit_blocks_have_ref_cnt_2_while_both_requests_live():
    manager = make_manager(num_blocks=8)
    a = make_request("a", tokens(10))
    prefill(manager, a)
    b = make_request("b", tokens(8) + [500, 501, 502])
    prefill(manager, b)
    shared = request_blocks(manager, a)[:2]
    assert request_blocks(manager, b)[:2] == shared
    assert [blk.ref_cnt for blk in shared] == [2, 2]
    assert request_blocks(manager, a)[2].ref_cnt == 1
    assert request_blocks(manager, b)[2].ref_cnt == 1


def test_hit_stops_at_the_first_block_that_differs():
    manager = make_manager(num_blocks=8)
    prefill(manager, make_request("a", tokens(13)))
    b = make_request("b", tokens(4) + [900, 901, 902, 903] + tokens(5, start=8))
    hit, num_hit_tokens = manager.get_computed_blocks(b)
    assert hit.get_block_ids() == [0]
    assert num_hit_tokens == 4


def test_identical_later_blocks_are_not_hit_after_a_different_first_block():
    manager = make_manager(num_blocks=8)
    prefill(manager, make_request("a", tokens(13)))
    b = make_request("b", [900, 901, 902, 903] + tokens(9, start=4))
    hit, num_hit_tokens = manager.get_computed_blocks(b)
    assert len(hit) == 0
    assert num_hit_tokens == 0


@pytest.mark.parametrize("shared_tokens", [4, 5, 6, 7, 8, 9, 11])
def test_num_hit_tokens_is_a_multiple_of_block_size(shared_tokens):
    manager = make_manager(num_blocks=16)
    prefill(manager, make_request("a", tokens(16)))
    b = make_request("b", tokens(shared_tokens) + tokens(8, start=1000))
    _, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens % BLOCK_SIZE == 0
    assert num_hit_tokens == (shared_tokens // BLOCK_SIZE) * BLOCK_SIZE


def test_full_prompt_hit_still_recomputes_the_last_token():
    manager = make_manager(num_blocks=8)
    prefill(manager, make_request("a", tokens(8)))
    b = make_request("b", tokens(8))
    hit, num_hit_tokens = manager.get_computed_blocks(b)
    # Capped at num_tokens - 1 = 7 tokens: one whole block fewer than is cached.
    assert hit.get_block_ids() == [0]
    assert num_hit_tokens == 4


def test_single_block_prompt_fully_cached_gets_no_hit():
    manager = make_manager(num_blocks=8)
    prefill(manager, make_request("a", tokens(4)))
    hit, num_hit_tokens = manager.get_computed_blocks(make_request("b", tokens(4)))
    assert len(hit) == 0
    assert num_hit_tokens == 0


def test_prompt_one_token_past_the_cached_blocks_hits_all_of_them():
    manager = make_manager(num_blocks=8)
    prefill(manager, make_request("a", tokens(8)))
    hit, num_hit_tokens = manager.get_computed_blocks(make_request("b", tokens(9)))
    assert hit.get_block_ids() == [0, 1]
    assert num_hit_tokens == 8


def test_allocation_after_a_hit_allocates_only_the_missing_blocks():
    manager = make_manager(num_blocks=8)
    prefill(manager, make_request("a", tokens(10)))
    b = make_request("b", tokens(8) + tokens(6, start=500))
    hit, num_hit_tokens = manager.get_computed_blocks(b)
    free_before = manager.get_num_free_blocks()
    new = manager.allocate_slots(b, b.num_tokens - num_hit_tokens, num_hit_tokens, hit)
    assert len(new) == 2  # 14 tokens need 4 blocks, 2 of them hit
    assert manager.get_num_free_blocks() == free_before - 2
    assert manager.get_block_ids("b") == hit.get_block_ids() + new.get_block_ids()


def test_full_prompt_hit_allocates_a_private_block_for_the_recomputed_block():
    manager = make_manager(num_blocks=8)
    prefill(manager, make_request("a", tokens(8)))
    b = make_request("b", tokens(8))
    prefill(manager, b)
    a_blocks = manager.get_block_ids("a")
    b_blocks = manager.get_block_ids("b")
    assert b_blocks[0] == a_blocks[0]
    assert b_blocks[1] not in a_blocks
    # The index keeps pointing at a's block for the second block's hash.
    assert manager.block_pool.get_cached_block(b.block_hashes[1]).block_id == a_blocks[1]


# ---------------------------------------------------------------------------------------------
# Cache salt
# ---------------------------------------------------------------------------------------------


def test_same_salt_gets_a_prefix_hit():
    manager = make_manager(num_blocks=8)
    prefill(manager, make_request("a", tokens(10), cache_salt="tenant-a"))
    _, num_hit_tokens = manager.get_computed_blocks(
        make_request("b", tokens(10), cache_salt="tenant-a")
    )
    assert num_hit_tokens == 8


def test_different_salt_gets_no_hit_on_salted_blocks():
    manager = make_manager(num_blocks=8)
    prefill(manager, make_request("a", tokens(10), cache_salt="tenant-a"))
    hit, num_hit_tokens = manager.get_computed_blocks(
        make_request("b", tokens(10), cache_salt="tenant-b")
    )
    assert len(hit) == 0
    assert num_hit_tokens == 0


def test_unsalted_request_gets_no_hit_on_salted_blocks():
    manager = make_manager(num_blocks=8)
    prefill(manager, make_request("a", tokens(10), cache_salt="tenant-a"))
    _, num_hit_tokens = manager.get_computed_blocks(make_request("b", tokens(10)))
    assert num_hit_tokens == 0


def test_salted_request_gets_no_hit_on_unsalted_blocks():
    manager = make_manager(num_blocks=8)
    prefill(manager, make_request("a", tokens(10)))
    _, num_hit_tokens = manager.get_computed_blocks(
        make_request("b", tokens(10), cache_salt="tenant-a")
    )
    assert num_hit_tokens == 0


def test_salt_changes_only_hashes_not_the_allocation():
    manager = make_manager(num_blocks=8)
    plain = make_request("a", tokens(10))
    salted = make_request("b", tokens(10), cache_salt="tenant-a")
    prefill(manager, plain)
    prefill(manager, salted)
    assert len(request_blocks(manager, salted)) == len(request_blocks(manager, plain)) == 3
    assert len(salted.block_hashes) == len(plain.block_hashes) == 2
    assert set(salted.block_hashes).isdisjoint(plain.block_hashes)
    assert len(manager.block_pool.cached_block_hash_to_block) == 4


# ---------------------------------------------------------------------------------------------
# Free and lazy eviction
# ---------------------------------------------------------------------------------------------


def test_free_returns_blocks_to_the_free_queue_tail_block_first():
    manager = make_manager(num_blocks=5)
    a = make_request("a", tokens(10))
    prefill(manager, a)
    manager.free(a)
    assert free_block_ids(manager) == [3, 4, 2, 1, 0]


def test_free_drops_every_ref_cnt_to_zero():
    manager = make_manager(num_blocks=5)
    a = make_request("a", tokens(10))
    prefill(manager, a)
    manager.free(a)
    assert ref_counts(manager) == [0] * 5
    assert manager.get_num_free_blocks() == 5


def test_free_keeps_hashes_and_index_entries():
    manager = make_manager(num_blocks=5)
    a = make_request("a", tokens(10))
    prefill(manager, a)
    index_before = index_snapshot(manager)
    manager.free(a)
    assert index_snapshot(manager) == index_before
    assert [manager.block_pool.blocks[i].block_hash for i in (0, 1)] == a.block_hashes


def test_free_forgets_the_request():
    manager = make_manager(num_blocks=5)
    a = make_request("a", tokens(10))
    prefill(manager, a)
    manager.free(a)
    assert "a" not in manager.req_to_blocks
    assert "a" not in manager.num_cached_blocks
    assert manager.get_block_ids("a") == []


def test_free_of_an_unknown_request_changes_nothing():
    manager = make_manager(num_blocks=5)
    prefill(manager, make_request("a", tokens(10)))
    before = state_snapshot(manager)
    manager.free(make_request("ghost", tokens(4)))
    assert state_snapshot(manager) == before


def test_request_hits_blocks_freed_by_a_finished_request():
    manager = make_manager(num_blocks=8)
    a = make_request("a", tokens(10))
    prefill(manager, a)
    a_ids = manager.get_block_ids("a")
    manager.free(a)
    hit, num_hit_tokens = manager.get_computed_blocks(make_request("b", tokens(10)))
    assert hit.get_block_ids() == a_ids[:2]
    assert num_hit_tokens == 8


def test_touching_freed_hit_blocks_takes_them_out_of_the_free_queue():
    manager = make_manager(num_blocks=6)
    a = make_request("a", tokens(10))
    prefill(manager, a)
    manager.free(a)
    b = make_request("b", tokens(10))
    prefill(manager, b)
    b_ids = manager.get_block_ids("b")
    assert b_ids[:2] == [0, 1]
    assert [manager.block_pool.blocks[i].ref_cnt for i in b_ids] == [1, 1, 1]
    assert not set(b_ids) & set(free_block_ids(manager))
    assert manager.get_num_free_blocks() == 3


def test_shared_block_stays_in_use_until_its_last_user_frees_it():
    manager = make_manager(num_blocks=8)
    a = make_request("a", tokens(10))
    b = make_request("b", tokens(8) + [500, 501])
    prefill(manager, a)
    prefill(manager, b)
    manager.free(a)
    assert [blk.ref_cnt for blk in request_blocks(manager, b)[:2]] == [1, 1]
    assert not {0, 1} & set(free_block_ids(manager))
    manager.free(b)
    assert {0, 1} <= set(free_block_ids(manager))


def test_freeing_a_hitting_request_queues_only_its_private_blocks():
    manager = make_manager(num_blocks=6)
    a = make_request("a", tokens(10))
    b = make_request("b", tokens(8) + [500, 501])
    prefill(manager, a)
    prefill(manager, b)
    b_private = manager.get_block_ids("b")[2]
    manager.free(b)
    assert free_block_ids(manager)[-1] == b_private
    assert manager.get_num_free_blocks() == 6 - 3


# ---------------------------------------------------------------------------------------------
# Eviction
# ---------------------------------------------------------------------------------------------


def test_never_used_blocks_are_allocated_before_freed_cached_ones():
    manager = make_manager(num_blocks=5)
    a = make_request("a", tokens(10))
    prefill(manager, a)
    manager.free(a)
    new = manager.allocate_slots(make_request("b", tokens(8, start=100)), 8)
    assert new.get_block_ids() == [3, 4]
    assert cached_block_ids(manager) >= {0, 1}


def test_eviction_follows_free_queue_order_tail_block_of_a_request_first():
    manager = make_manager(num_blocks=3)
    a = make_request("a", tokens(12))
    prefill(manager, a)
    manager.free(a)  # free queue: 2, 1, 0
    new = manager.allocate_slots(make_request("b", tokens(3, start=100)), 3)
    assert new.get_block_ids() == [2]
    assert index_snapshot(manager) == {a.block_hashes[0]: 0, a.block_hashes[1]: 1}


def test_least_recently_freed_request_is_evicted_first():
    manager = make_manager(num_blocks=4)
    a = make_request("a", tokens(8))
    b = make_request("b", tokens(8, start=100))
    prefill(manager, a)
    prefill(manager, b)
    manager.free(a)
    manager.free(b)  # free queue: 1, 0, 3, 2
    new = manager.allocate_slots(make_request("c", tokens(8, start=200)), 8)
    assert new.get_block_ids() == [1, 0]
    assert manager.get_computed_blocks(make_request("a2", tokens(9)))[1] == 0
    assert manager.get_computed_blocks(make_request("b2", tokens(9, start=100)))[1] == 8


def test_reallocated_cached_block_loses_its_hash_and_index_entry():
    manager = make_manager(num_blocks=3)
    a = make_request("a", tokens(12))
    prefill(manager, a)
    evicted_hash = a.block_hashes[2]
    manager.free(a)
    # A 3-token request fills no block, so nothing re-caches the reallocated block.
    manager.allocate_slots(make_request("b", tokens(3, start=100)), 3)
    block = manager.block_pool.blocks[2]
    assert block.block_hash is None
    assert evicted_hash not in manager.block_pool.cached_block_hash_to_block


def test_evicted_prefix_no_longer_hits():
    manager = make_manager(num_blocks=2)
    a = make_request("a", tokens(8))
    prefill(manager, a)
    manager.free(a)
    b = make_request("b", tokens(8, start=100))
    manager.allocate_slots(b, 8)
    manager.free(b)
    _, num_hit_tokens = manager.get_computed_blocks(make_request("c", tokens(9)))
    assert num_hit_tokens == 0


def test_freed_cached_block_is_reused_before_eviction_when_its_prefix_returns():
    manager = make_manager(num_blocks=4)
    a = make_request("a", tokens(8))
    prefill(manager, a)
    manager.free(a)  # free queue: 2, 3, 1, 0
    b = make_request("b", tokens(8) + [500])
    hit, num_hit_tokens = prefill(manager, b)
    assert hit.get_block_ids() == [0, 1]
    assert num_hit_tokens == 8
    assert manager.get_block_ids("b") == [0, 1, 2]
    assert index_snapshot(manager) == {a.block_hashes[0]: 0, a.block_hashes[1]: 1}


def test_a_prefix_hit_moves_the_prefix_to_the_back_of_the_eviction_order():
    manager = make_manager(num_blocks=5)
    a = make_request("a", tokens(8))
    other = make_request("o", tokens(8, start=100))
    prefill(manager, a)
    prefill(manager, other)
    manager.free(a)
    manager.free(other)  # free queue: 4, 1, 0, 3, 2 -> a's prefix would be evicted first
    b = make_request("b", tokens(8) + [500])
    prefill(manager, b)  # hits blocks 0 and 1, takes block 4
    manager.free(b)  # free queue: 3, 2, 4, 1, 0
    manager.allocate_slots(make_request("c", tokens(8, start=200)), 8)
    assert manager.get_computed_blocks(make_request("a2", tokens(9)))[1] == 8
    assert manager.get_computed_blocks(make_request("o2", tokens(9, start=100)))[1] == 0


# ---------------------------------------------------------------------------------------------
# Failed allocation is atomic
# ---------------------------------------------------------------------------------------------


def test_allocation_larger_than_the_pool_returns_none():
    manager = make_manager(num_blocks=2)
    assert manager.allocate_slots(make_request("a", tokens(9)), 9) is None


def test_failed_prefill_allocation_leaves_state_unchanged():
    manager = make_manager(num_blocks=4)
    prefill(manager, make_request("a", tokens(10)))
    before = state_snapshot(manager)
    big = make_request("b", tokens(8, start=100))
    assert manager.allocate_slots(big, 8) is None
    assert state_snapshot(manager) == before
    assert "b" not in manager.req_to_blocks


def test_failed_allocation_does_not_evict_cached_free_blocks():
    manager = make_manager(num_blocks=4)
    a = make_request("a", tokens(8))
    prefill(manager, a)
    manager.free(a)
    before = state_snapshot(manager)
    assert manager.allocate_slots(make_request("b", tokens(17, start=100)), 17) is None
    assert state_snapshot(manager) == before
    assert manager.get_computed_blocks(make_request("c", tokens(9)))[1] == 8


def test_free_hit_blocks_count_against_the_pool_so_allocation_fails_without_state_change():
    manager = make_manager(num_blocks=4)
    a = make_request("a", tokens(9))
    prefill(manager, a)
    manager.free(a)  # 4 free blocks, blocks 0 and 1 cached
    b = make_request("b", tokens(8) + tokens(9, start=100))  # 17 tokens: 5 blocks
    hit, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 8
    before = state_snapshot(manager)
    # 3 new blocks fit the 4 free ones, but touching the 2 hits takes them out of the pool too.
    result = manager.allocate_slots(b, b.num_tokens - num_hit_tokens, num_hit_tokens, hit)
    assert result is None
    assert state_snapshot(manager) == before
    assert [blk.ref_cnt for blk in hit.blocks] == [0, 0]


def test_free_hit_blocks_plus_new_blocks_that_exactly_fill_the_pool_succeed():
    manager = make_manager(num_blocks=4)
    a = make_request("a", tokens(9))
    prefill(manager, a)
    manager.free(a)
    b = make_request("b", tokens(8) + tokens(8, start=100))  # 16 tokens: 4 blocks
    hit, num_hit_tokens = manager.get_computed_blocks(b)
    new = manager.allocate_slots(b, b.num_tokens - num_hit_tokens, num_hit_tokens, hit)
    assert new is not None
    assert len(new) == 2
    assert manager.get_num_free_blocks() == 0
    assert manager.get_block_ids("b")[:2] == [0, 1]


def test_failed_decode_allocation_keeps_the_running_request_blocks():
    manager = make_manager(num_blocks=2)
    a = make_request("a", tokens(8))
    prefill(manager, a)
    a.append_output_token(99)
    before = state_snapshot(manager)
    assert manager.allocate_slots(a, 1) is None
    assert state_snapshot(manager) == before
    assert manager.get_block_ids("a") == [0, 1]


# ---------------------------------------------------------------------------------------------
# Decode growth and incremental caching
# ---------------------------------------------------------------------------------------------


def test_decode_inside_the_last_block_allocates_nothing():
    manager = make_manager(num_blocks=8)
    a = make_request("a", tokens(6))
    prefill(manager, a)
    new = decode_step(manager, a, 100)
    assert len(new) == 0
    assert manager.get_block_ids("a") == [0, 1]


def test_decode_allocates_a_new_block_only_at_block_boundaries():
    manager = make_manager(num_blocks=8)
    a = make_request("a", tokens(4))
    prefill(manager, a)
    new_counts = [len(decode_step(manager, a, 100 + i)) for i in range(9)]
    # Tokens 5..13: a new block for tokens 5, 9 and 13.
    assert new_counts == [1, 0, 0, 0, 1, 0, 0, 0, 1]
    assert len(manager.get_block_ids("a")) == 4
    assert manager.get_num_free_blocks() == 4


def test_decode_block_count_matches_token_count():
    manager = make_manager(num_blocks=8)
    a = make_request("a", tokens(3))
    prefill(manager, a)
    for i in range(10):
        decode_step(manager, a, 100 + i)
        assert len(manager.get_block_ids("a")) == -(-a.num_tokens // BLOCK_SIZE)


def test_block_filled_by_output_tokens_is_cached_when_its_last_token_is_scheduled():
    manager = make_manager(num_blocks=8)
    a = make_request("a", tokens(6))
    prefill(manager, a)
    assert cached_block_ids(manager) == {0}
    decode_step(manager, a, 100)  # 7 tokens
    assert cached_block_ids(manager) == {0}
    decode_step(manager, a, 101)  # 8 tokens: block 1 is full
    assert cached_block_ids(manager) == {0, 1}
    assert manager.block_pool.blocks[1].block_hash == a.block_hashes[1]
    assert manager.num_cached_blocks["a"] == 2


def test_block_of_output_tokens_is_hit_by_a_prompt_with_the_same_tokens():
    manager = make_manager(num_blocks=8)
    a = make_request("a", tokens(4))
    prefill(manager, a)
    for t in (100, 101, 102, 103):
        decode_step(manager, a, t)
    b = make_request("b", tokens(4) + [100, 101, 102, 103, 7])
    hit, num_hit_tokens = manager.get_computed_blocks(b)
    assert hit.get_block_ids() == [0, 1]
    assert num_hit_tokens == 8


def test_cache_blocks_registers_newly_full_blocks_as_outputs_are_appended():
    manager = make_manager(num_blocks=8)
    a = make_request("a", tokens(4))
    # Room for 12 tokens up front, cached by hand as outputs arrive.
    manager.allocate_slots(a, 12, delay_cache_blocks=True)
    assert cached_block_ids(manager) == set()
    manager.cache_blocks(a, 4)
    assert cached_block_ids(manager) == {0}
    for t in (100, 101, 102):
        a.append_output_token(t)
    manager.cache_blocks(a, 7)
    assert cached_block_ids(manager) == {0}
    a.append_output_token(103)
    manager.cache_blocks(a, 8)
    assert cached_block_ids(manager) == {0, 1}
    assert len(a.block_hashes) == 2


def test_cache_blocks_never_caches_more_than_the_computed_tokens():
    manager = make_manager(num_blocks=8)
    a = make_request("a", tokens(12))
    manager.allocate_slots(a, 12, delay_cache_blocks=True)
    manager.cache_blocks(a, 5)
    assert cached_block_ids(manager) == {0}
    assert manager.num_cached_blocks["a"] == 1


def test_chunked_prefill_caches_only_the_full_blocks_computed_so_far():
    manager = make_manager(num_blocks=8)
    a = make_request("a", tokens(12))
    assert len(manager.allocate_slots(a, 6)) == 2
    assert cached_block_ids(manager) == {0}
    a.num_computed_tokens = 6
    assert len(manager.allocate_slots(a, 6)) == 1
    assert cached_block_ids(manager) == {0, 1, 2}


def test_delay_cache_blocks_allocates_without_caching():
    manager = make_manager(num_blocks=8)
    a = make_request("a", tokens(8))
    new = manager.allocate_slots(a, 0, num_external_computed_tokens=8, delay_cache_blocks=True)
    assert new.get_block_ids() == [0, 1]
    assert cached_block_ids(manager) == set()
    assert all(b.block_hash is None for b in request_blocks(manager, a))


def test_external_computed_tokens_get_fresh_blocks_after_the_local_hit():
    manager = make_manager(num_blocks=8)
    prefill(manager, make_request("a", tokens(9)))
    b = make_request("b", tokens(17))
    hit, num_hit_tokens = manager.get_computed_blocks(b)
    new = manager.allocate_slots(
        b, b.num_tokens - num_hit_tokens - 4, num_hit_tokens, hit, num_external_computed_tokens=4
    )
    assert num_hit_tokens == 8
    assert len(new) == 3  # 17 tokens need 5 blocks; 2 are hit, the external 4 need a new one
    assert manager.get_block_ids("b")[:2] == hit.get_block_ids()


def test_preempted_request_caches_its_blocks_again_when_readmitted():
    manager = make_manager(num_blocks=8)
    a = make_request("a", tokens(9))
    prefill(manager, a)
    # Recompute preemption: free everything and rewind.
    manager.free(a)
    a.num_computed_tokens = 0
    a.num_preemptions += 1
    assert manager.reset_prefix_cache() is True
    prefill(manager, a)
    blocks = request_blocks(manager, a)
    assert [b.block_hash for b in blocks[:2]] == a.block_hashes
    assert index_snapshot(manager) == {
        a.block_hashes[0]: blocks[0].block_id,
        a.block_hashes[1]: blocks[1].block_id,
    }


# ---------------------------------------------------------------------------------------------
# reset_prefix_cache
# ---------------------------------------------------------------------------------------------


def test_reset_prefix_cache_fails_while_a_request_holds_blocks():
    manager = make_manager(num_blocks=8)
    a = make_request("a", tokens(10))
    prefill(manager, a)
    index_before = index_snapshot(manager)
    assert manager.reset_prefix_cache() is False
    assert index_snapshot(manager) == index_before
    assert manager.stats.requests == 1


def test_reset_prefix_cache_succeeds_after_everything_is_freed():
    manager = make_manager(num_blocks=8)
    a = make_request("a", tokens(10))
    prefill(manager, a)
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in manager.block_pool.blocks)
    assert manager.get_num_free_blocks() == 8


def test_reset_prefix_cache_clears_stats():
    manager = make_manager(num_blocks=8)
    a = make_request("a", tokens(10))
    b = make_request("b", tokens(10))
    prefill(manager, a)
    prefill(manager, b)
    manager.free(a)
    manager.free(b)
    assert manager.reset_prefix_cache() is True
    assert (manager.stats.requests, manager.stats.queries, manager.stats.hits) == (0, 0, 0)
    assert manager.stats.hit_rate == 0.0


def test_no_hit_after_reset_prefix_cache():
    manager = make_manager(num_blocks=8)
    a = make_request("a", tokens(10))
    prefill(manager, a)
    manager.free(a)
    manager.reset_prefix_cache()
    _, num_hit_tokens = manager.get_computed_blocks(make_request("b", tokens(10)))
    assert num_hit_tokens == 0


# ---------------------------------------------------------------------------------------------
# PrefixCacheStats
# ---------------------------------------------------------------------------------------------


def test_hit_rate_is_zero_before_any_query():
    assert make_manager().stats.hit_rate == 0.0


def test_stats_count_a_miss_then_a_hit():
    manager = make_manager(num_blocks=8)
    prefill(manager, make_request("a", tokens(10)))
    stats = manager.stats
    assert (stats.requests, stats.queries, stats.hits) == (1, 10, 0)
    prefill(manager, make_request("b", tokens(10)))
    assert (stats.requests, stats.queries, stats.hits) == (2, 20, 8)
    assert stats.hit_rate == pytest.approx(8 / 20)


def test_stats_ignore_lookups_that_are_not_admitted():
    manager = make_manager(num_blocks=8)
    a = make_request("a", tokens(10))
    prefill(manager, a)
    b = make_request("b", tokens(10))
    _, num_hit_tokens = manager.get_computed_blocks(b)  # e.g. allocation then fails
    assert num_hit_tokens == 8
    assert (manager.stats.requests, manager.stats.queries, manager.stats.hits) == (1, 10, 0)


# ---------------------------------------------------------------------------------------------
# enable_caching=False
# ---------------------------------------------------------------------------------------------


def test_without_caching_full_blocks_get_no_hash():
    manager = make_manager(num_blocks=8, enable_caching=False)
    a = make_request("a", tokens(10))
    prefill(manager, a)
    assert all(b.block_hash is None for b in request_blocks(manager, a))
    assert manager.block_pool.cached_block_hash_to_block == {}


def test_without_caching_an_identical_prompt_gets_no_hit():
    manager = make_manager(num_blocks=8, enable_caching=False)
    a = make_request("a", tokens(10))
    prefill(manager, a)
    manager.free(a)
    hit, num_hit_tokens = manager.get_computed_blocks(make_request("b", tokens(10)))
    assert len(hit) == 0
    assert num_hit_tokens == 0


def test_without_caching_a_concurrent_identical_prompt_gets_its_own_blocks():
    manager = make_manager(num_blocks=8, enable_caching=False)
    prefill(manager, make_request("a", tokens(10)))
    prefill(manager, make_request("b", tokens(10)))
    assert set(manager.get_block_ids("a")).isdisjoint(manager.get_block_ids("b"))
    assert ref_counts(manager).count(1) == 6


def test_without_caching_stats_stay_empty():
    manager = make_manager(num_blocks=8, enable_caching=False)
    prefill(manager, make_request("a", tokens(10)))
    prefill(manager, make_request("b", tokens(10)))
    assert (manager.stats.requests, manager.stats.queries, manager.stats.hits) == (0, 0, 0)


def test_without_caching_cache_blocks_is_a_no_op():
    manager = make_manager(num_blocks=8, enable_caching=False)
    a = make_request("a", tokens(8))
    prefill(manager, a)
    manager.cache_blocks(a, 8)
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert a.block_hashes == []
