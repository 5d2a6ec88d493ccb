"""KV events (engine.kv_cache.events) and the prefix index they feed
(engine.kv_cache.prefix_index): the index always mirrors the pool, a consumer that falls
behind rebuilds from a snapshot, and equal prefixes hash alike in every process."""

from __future__ import annotations

import os
import random
import subprocess
import sys

from engine.kv_cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineKVEvents,
    KVEventBatch,
    KVSnapshot,
)
from engine.kv_cache.hashing import extend_block_hashes
from engine.kv_cache.prefix_index import PrefixIndex, key
from tests.engine.kv_factories import BLOCK_SIZE, make_manager, make_request, prefill, tokens


def _events(manager):
    events = EngineKVEvents(manager)
    return events, events.log


def test_a_prefill_stores_its_full_blocks_with_parent_and_token_count():
    manager = make_manager(num_blocks=8)
    _, log = _events(manager)
    request = make_request("a", tokens(3 * BLOCK_SIZE + 1))
    prefill(manager, request)
    batch = log.end_step()
    assert batch.seq == 1
    (stored,) = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == tuple(request.block_hashes[:3])
    assert stored.parent_block_hash is None and stored.num_tokens == 3 * BLOCK_SIZE
    assert stored.medium == "device"


def test_a_prefix_hit_stores_only_the_new_blocks_under_their_parent():
    manager = make_manager(num_blocks=16)
    _, log = _events(manager)
    prefill(manager, make_request("a", tokens(2 * BLOCK_SIZE)))
    log.end_step()
    b = make_request("b", tokens(2 * BLOCK_SIZE) + tokens(BLOCK_SIZE, start=500))
    prefill(manager, b)
    (stored,) = log.end_step().events
    assert stored.block_hashes == (b.block_hashes[2],)
    assert stored.parent_block_hash == b.block_hashes[1]


def test_eviction_and_reset_are_told():
    manager = make_manager(num_blocks=4)
    _, log = _events(manager)
    a = make_request("a", tokens(2 * BLOCK_SIZE))
    prefill(manager, a)
    manager.free(a)
    log.end_step()
    # Needs every block: the two cached ones are evicted.
    prefill(manager, make_request("b", tokens(4 * BLOCK_SIZE, start=100)))
    events = log.end_step().events
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(a.block_hashes[:2])
    manager.free_by_id("b")
    assert manager.reset_prefix_cache()
    assert log.end_step().events == (AllBlocksCleared(),)


def test_the_index_mirrors_the_pool_through_random_traffic():
    rng = random.Random(7)
    manager = make_manager(num_blocks=24)
    events, log = _events(manager)
    index, seen = PrefixIndex(), 0
    live = []
    prefixes = [tokens(BLOCK_SIZE * k, start=1000 * k) for k in range(1, 5)]
    for i in range(300):
        if live and (rng.random() < 0.45 or manager.get_num_free_blocks() < 8):
            manager.free(live.pop(rng.randrange(len(live))))
        else:
            prompt = rng.choice(prefixes) + tokens(rng.randrange(1, 3 * BLOCK_SIZE), start=10 * i)
            request = make_request(f"r{i}", prompt)
            prefill(manager, request)
            live.append(request)
        if rng.random() < 0.3:
            assert index.update("e", log.since(seen))
            seen = log.seq
            assert set(index.held("e", "device")) == {key(h) for h in manager.cached_hashes()}


def test_a_consumer_that_fell_behind_gets_a_snapshot_and_rebuilds():
    manager = make_manager(num_blocks=16)
    events = EngineKVEvents(manager, max_batches=2)
    for i in range(5):
        prefill(manager, make_request(f"r{i}", tokens(BLOCK_SIZE, start=100 * i)))
        events.end_step()
    update = events.since(0)
    assert isinstance(update, KVSnapshot) and update.seq == 5
    index = PrefixIndex()
    assert index.update("e", update)
    assert set(index.held("e", "device")) == {key(h) for h in manager.cached_hashes()}
    # A batch past a gap is refused (the caller asks for a snapshot), one in order applies.
    assert not index.apply("e", KVEventBatch(7, ()))
    assert index.apply("e", KVEventBatch(6, ()))


def test_match_is_the_longest_prefix_over_all_media_and_the_bound_drops_the_oldest():
    index = PrefixIndex(max_blocks=3)
    h = [bytes([i]) * 32 for i in range(6)]
    index.apply("r", KVEventBatch(1, (BlockStored(tuple(h[:2]), None, 32),
                                      BlockStored((h[2],), h[1], 16, medium="host"))))
    m = index.match("r", h[:5])
    assert (m.blocks, m.device, m.host, m.shared) == (3, 2, 1, 0)
    assert index.match("other", h).blocks == 0
    index.apply("r", KVEventBatch(2, (BlockStored(tuple(h[3:5]), h[2], 32),)))
    assert index.counts("r")["device"] == 3  # h[0] dropped: the oldest
    assert index.match("r", h).blocks == 0


def test_equal_prefixes_hash_alike_in_another_process():
    """Python's own hash is salted per process; the chained hash must not be."""
    code = ("from engine.kv_cache.hashing import extend_block_hashes as e; h = [];"
            "e(h, list(range(40)), 16, 's', lora_name='l'); print(h[-1].hex())")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2)}
    here: list[bytes] = []
    extend_block_hashes(here, list(range(40)), 16, "s", lora_name="l")
    assert runs == {here[-1].hex() + "\n"}
