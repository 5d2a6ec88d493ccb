"""Specification of the paged KV-cache primitives: blocks, the LRU free queue, chained block
hashes and the BlockPool (ref counts, lazy eviction, prefix-cache index)."""

from __future__ import annotations

import pytest

from engine.kv_cache import NONE_HASH, BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from engine.kv_cache.hashing import extend_block_hashes, hash_block_tokens
from tests.engine.kv_factories import cached_block_ids, free_block_ids, make_pool, tokens


def make_blocks(n: int) -> list[KVCacheBlock]:
    return [KVCacheBlock(i) for i in range(n)]


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def hash_of(i: int) -> bytes:
    """A distinct stand-in hash for block-pool tests that do not care about content."""
    return hash_block_tokens(None, [i])


# ---------------------------------------------------------------------------------------------
# KVCacheBlock
# ---------------------------------------------------------------------------------------------


def test_new_block_is_unreferenced_uncached_and_unlinked():
    block = KVCacheBlock(7)
    assert block.block_id == 7
    assert block.ref_cnt == 0
    assert block.block_hash is None
    assert block.prev_free is None and block.next_free is None


# ---------------------------------------------------------------------------------------------
# FreeKVCacheBlockQueue
# ---------------------------------------------------------------------------------------------


def test_free_queue_initial_order_is_the_given_order():
    blocks = make_blocks(5)
    queue = FreeKVCacheBlockQueue([blocks[i] for i in (3, 0, 4, 1, 2)])
    assert ids(queue.get_all_free_blocks()) == [3, 0, 4, 1, 2]


def test_free_queue_counts_its_initial_blocks():
    queue = FreeKVCacheBlockQueue(make_blocks(6))
    assert queue.num_free_blocks == 6


def test_free_queue_of_no_blocks_is_empty():
    queue = FreeKVCacheBlockQueue([])
    assert queue.num_free_blocks == 0
    assert queue.get_all_free_blocks() == []


def test_popleft_returns_blocks_from_the_head_in_order():
    queue = FreeKVCacheBlockQueue(make_blocks(4))
    assert [queue.popleft().block_id for _ in range(4)] == [0, 1, 2, 3]
    assert queue.num_free_blocks == 0


def test_popleft_unlinks_the_returned_block():
    queue = FreeKVCacheBlockQueue(make_blocks(3))
    block = queue.popleft()
    assert block.prev_free is None and block.next_free is None
    assert ids(queue.get_all_free_blocks()) == [1, 2]


def test_popleft_on_empty_queue_raises():
    queue = FreeKVCacheBlockQueue(make_blocks(1))
    queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft()
    assert queue.num_free_blocks == 0


def test_remove_from_the_middle_links_its_neighbours_directly():
    blocks = make_blocks(5)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    # O(1) unlink: the neighbours now point at each other, nothing else moved.
    assert blocks[1].next_free is blocks[3]
    assert blocks[3].prev_free is blocks[1]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert ids(queue.get_all_free_blocks()) == [0, 1, 3, 4]
    assert queue.num_free_blocks == 4


def test_remove_the_head_makes_the_next_block_pop_first():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[0])
    assert queue.popleft() is blocks[1]


def test_remove_the_tail_keeps_append_working():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.append(blocks[2])
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2]


def test_remove_a_block_not_in_the_queue_raises():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks[:2])
    with pytest.raises(RuntimeError):
        queue.remove(blocks[2])
    assert queue.num_free_blocks == 2


def test_remove_the_same_block_twice_raises():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[1])
    with pytest.raises(RuntimeError):
        queue.remove(blocks[1])
    assert queue.num_free_blocks == 2


def test_append_puts_the_block_at_the_tail():
    blocks = make_blocks(4)
    queue = FreeKVCacheBlockQueue(blocks[:3])
    queue.append(blocks[3])
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 3]
    assert queue.num_free_blocks == 4


def test_appended_blocks_pop_in_append_order():
    blocks = make_blocks(4)
    queue = FreeKVCacheBlockQueue([])
    for i in (2, 0, 3, 1):
        queue.append(blocks[i])
    assert [queue.popleft().block_id for _ in range(4)] == [2, 0, 3, 1]


def test_a_popped_block_appended_again_goes_behind_the_others():
    queue = FreeKVCacheBlockQueue(make_blocks(3))
    first = queue.popleft()
    queue.append(first)
    assert ids(queue.get_all_free_blocks()) == [1, 2, 0]


def test_get_all_free_blocks_does_not_consume_the_queue():
    queue = FreeKVCacheBlockQueue(make_blocks(3))
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2]
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2]
    assert queue.num_free_blocks == 3


def test_get_all_free_blocks_reflects_interleaved_remove_popleft_and_append():
    blocks = make_blocks(6)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[3])
    queue.popleft()  # 0
    queue.append(blocks[3])
    queue.remove(blocks[5])
    assert ids(queue.get_all_free_blocks()) == [1, 2, 4, 3]
    assert queue.num_free_blocks == 4


# ---------------------------------------------------------------------------------------------
# Block hashes
# ---------------------------------------------------------------------------------------------


def test_block_hash_is_deterministic():
    assert hash_block_tokens(None, [1, 2, 3, 4]) == hash_block_tokens(None, [1, 2, 3, 4])


def test_block_hash_accepts_a_tuple_of_tokens_like_a_list():
    assert hash_block_tokens(None, (1, 2, 3, 4)) == hash_block_tokens(None, [1, 2, 3, 4])


def test_first_block_hashes_from_the_root_hash():
    assert hash_block_tokens(None, [1, 2, 3, 4]) == hash_block_tokens(NONE_HASH, [1, 2, 3, 4])


def test_block_hash_depends_on_every_token_and_its_position():
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 5]) != base
    assert hash_block_tokens(None, [4, 3, 2, 1]) != base


def test_same_tokens_under_a_different_parent_hash_differently():
    parent_a = hash_block_tokens(None, [1, 2, 3, 4])
    parent_b = hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(parent_a, [9, 9, 9, 9]) != hash_block_tokens(parent_b, [9, 9, 9, 9])


def test_first_block_and_later_block_with_same_tokens_hash_differently():
    parent = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(parent, [1, 2, 3, 4]) != hash_block_tokens(None, [1, 2, 3, 4])


def test_extra_keys_change_the_block_hash():
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt",)) != hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 4], ("a",)) != hash_block_tokens(
        None, [1, 2, 3, 4], ("b",)
    )


def test_extend_block_hashes_chains_each_block_on_the_previous_one():
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens(8), 4, None)
    first = hash_block_tokens(None, tokens(4))
    assert hashes == [first, hash_block_tokens(first, tokens(4, start=4))]


def test_identical_prefixes_give_identical_block_hashes():
    a: list[bytes] = []
    b: list[bytes] = []
    extend_block_hashes(a, tokens(8) + [100, 101, 102, 103], 4, None)
    extend_block_hashes(b, tokens(8) + [200, 201, 202, 203], 4, None)
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_blocks_after_a_divergent_block_differ_even_with_identical_tokens():
    a: list[bytes] = []
    b: list[bytes] = []
    extend_block_hashes(a, [0, 0, 0, 0] + tokens(8, start=10), 4, None)
    extend_block_hashes(b, [1, 1, 1, 1] + tokens(8, start=10), 4, None)
    assert all(x != y for x, y in zip(a, b))


def test_partial_trailing_block_is_never_hashed():
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens(11), 4, None)
    assert len(hashes) == 2


def test_fewer_tokens_than_a_block_give_no_hash():
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens(3), 4, None)
    assert hashes == []


def test_extend_block_hashes_only_appends_newly_full_blocks():
    all_tokens = tokens(6)
    hashes: list[bytes] = []
    extend_block_hashes(hashes, all_tokens, 4, None)
    first = list(hashes)
    all_tokens += [6, 7, 8]
    extend_block_hashes(hashes, all_tokens, 4, None)
    expected: list[bytes] = []
    extend_block_hashes(expected, tokens(9), 4, None)
    assert hashes[:1] == first
    assert hashes == expected


def test_cache_salt_changes_every_block_hash_but_not_the_count():
    plain: list[bytes] = []
    salted: list[bytes] = []
    extend_block_hashes(plain, tokens(10), 4, None)
    extend_block_hashes(salted, tokens(10), 4, "tenant-a")
    assert len(salted) == len(plain) == 2
    assert all(p != s for p, s in zip(plain, salted))


def test_different_cache_salts_give_different_hashes():
    a: list[bytes] = []
    b: list[bytes] = []
    extend_block_hashes(a, tokens(8), 4, "tenant-a")
    extend_block_hashes(b, tokens(8), 4, "tenant-b")
    assert all(x != y for x, y in zip(a, b))


def test_cache_salt_is_applied_to_the_first_block_only():
    salted: list[bytes] = []
    extend_block_hashes(salted, tokens(8), 4, "tenant-a")
    first = hash_block_tokens(None, tokens(4), ("tenant-a",))
    assert salted == [first, hash_block_tokens(first, tokens(4, start=4))]


# ---------------------------------------------------------------------------------------------
# BlockPool
# ---------------------------------------------------------------------------------------------


def test_pool_rejects_fewer_than_one_block():
    with pytest.raises(ValueError):
        BlockPool(0, enable_caching=True)


def test_new_pool_has_every_block_free_in_id_order_and_nothing_cached():
    pool = make_pool(5)
    assert free_block_ids(pool) == [0, 1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 5
    assert pool.cached_block_hash_to_block == {}
    assert pool.get_usage() == 0.0


def test_get_new_blocks_takes_from_the_head_with_ref_cnt_1():
    pool = make_pool(5)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert free_block_ids(pool) == [3, 4]


def test_get_new_blocks_beyond_the_free_count_raises_and_takes_nothing():
    pool = make_pool(3)
    pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert free_block_ids(pool) == [1, 2]


def test_get_zero_new_blocks_returns_nothing():
    pool = make_pool(3)
    assert pool.get_new_blocks(0) == []
    assert pool.get_num_free_blocks() == 3


def test_usage_is_the_fraction_of_blocks_in_use():
    pool = make_pool(4)
    pool.get_new_blocks(1)
    assert pool.get_usage() == pytest.approx(0.25)
    pool.get_new_blocks(3)
    assert pool.get_usage() == pytest.approx(1.0)


def test_cache_full_blocks_registers_each_block_under_its_hash():
    pool = make_pool(4)
    blocks = pool.get_new_blocks(2)
    hashes = [hash_of(0), hash_of(1)]
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    assert [b.block_hash for b in blocks] == hashes
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.get_cached_block(hashes[1]) is blocks[1]


def test_cache_full_blocks_registers_only_the_given_range():
    pool = make_pool(4)
    blocks = pool.get_new_blocks(3)
    hashes = [hash_of(0), hash_of(1), hash_of(2)]
    pool.cache_full_blocks(blocks, hashes, 1, 2)
    assert [b.block_hash for b in blocks] == [None, hashes[1], None]
    assert cached_block_ids(pool) == {blocks[1].block_id}


def test_get_cached_block_misses_an_unknown_hash():
    pool = make_pool(2)
    assert pool.get_cached_block(hash_of(0)) is None


def test_first_block_cached_under_a_hash_stays_canonical_for_duplicates():
    pool = make_pool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [hash_of(0)], 0, 1)
    pool.cache_full_blocks([b], [hash_of(0)], 0, 1)
    assert pool.get_cached_block(hash_of(0)) is a
    assert b.block_hash == hash_of(0)  # private duplicate: hashed but not indexed


def test_cache_full_blocks_leaves_an_already_cached_block_alone():
    pool = make_pool(2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [hash_of(0)], 0, 1)
    pool.cache_full_blocks([block], [hash_of(1)], 0, 1)
    assert block.block_hash == hash_of(0)
    assert pool.get_cached_block(hash_of(1)) is None


def test_freed_block_joins_the_free_queue_tail_with_ref_cnt_0():
    pool = make_pool(3)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert free_block_ids(pool) == [1, 2, 0]


def test_free_blocks_appends_in_the_given_order():
    pool = make_pool(4)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks([blocks[2], blocks[0], blocks[1]])
    assert free_block_ids(pool) == [3, 2, 0, 1]


def test_freed_cached_block_keeps_its_hash_and_index_entry():
    pool = make_pool(3)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [hash_of(0)], 0, 1)
    pool.free_blocks([block])
    assert block.block_hash == hash_of(0)
    assert pool.get_cached_block(hash_of(0)) is block


def test_block_with_other_references_stays_out_of_the_free_queue_when_freed():
    pool = make_pool(3)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert 0 not in free_block_ids(pool)
    assert pool.get_num_free_blocks() == 2


def test_freeing_a_block_twice_fails_loudly():
    pool = make_pool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="freed more times"):
        pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.get_num_free_blocks() == 2


def test_touch_pulls_a_free_cached_block_out_of_the_middle_of_the_free_queue():
    pool = make_pool(4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [hash_of(0), hash_of(1), hash_of(2)], 0, 3)
    pool.free_blocks(blocks)
    assert free_block_ids(pool) == [3, 0, 1, 2]
    pool.touch([blocks[1]])
    assert blocks[1].ref_cnt == 1
    assert free_block_ids(pool) == [3, 0, 2]
    assert pool.get_num_free_blocks() == 3


def test_touch_on_a_block_in_use_only_adds_a_reference():
    pool = make_pool(3)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    assert free_block_ids(pool) == [1, 2]


def test_reallocating_a_free_cached_block_evicts_its_hash():
    pool = make_pool(1)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [hash_of(0)], 0, 1)
    pool.free_blocks([block])
    (again,) = pool.get_new_blocks(1)
    assert again is block
    assert block.block_hash is None
    assert pool.get_cached_block(hash_of(0)) is None
    assert pool.cached_block_hash_to_block == {}


def test_eviction_takes_the_head_of_the_free_queue_first():
    pool = make_pool(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [hash_of(0), hash_of(1), hash_of(2)], 0, 3)
    pool.free_blocks([blocks[1], blocks[2], blocks[0]])
    (evicted,) = pool.get_new_blocks(1)
    assert evicted is blocks[1]
    assert pool.get_cached_block(hash_of(1)) is None
    assert pool.get_cached_block(hash_of(0)) is blocks[0]
    assert pool.get_cached_block(hash_of(2)) is blocks[2]


def test_reallocating_a_private_duplicate_keeps_the_canonical_index_entry():
    pool = make_pool(2)
    canonical, duplicate = pool.get_new_blocks(2)
    pool.cache_full_blocks([canonical], [hash_of(0)], 0, 1)
    pool.cache_full_blocks([duplicate], [hash_of(0)], 0, 1)
    pool.free_blocks([duplicate])
    (again,) = pool.get_new_blocks(1)
    assert again is duplicate
    assert duplicate.block_hash is None
    assert pool.get_cached_block(hash_of(0)) is canonical


def test_without_caching_a_freed_block_loses_its_hash():
    pool = make_pool(2, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    block.block_hash = hash_of(0)
    pool.free_blocks([block])
    assert block.block_hash is None


def test_reset_prefix_cache_fails_while_a_block_is_in_use():
    pool = make_pool(2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [hash_of(0)], 0, 1)
    assert pool.reset_prefix_cache() is False
    assert block.block_hash == hash_of(0)
    assert pool.get_cached_block(hash_of(0)) is block


def test_reset_prefix_cache_clears_every_hash_once_all_blocks_are_free():
    pool = make_pool(3)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [hash_of(0), hash_of(1)], 0, 2)
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.cached_block_hash_to_block == {}
    assert pool.get_num_free_blocks() == 3
