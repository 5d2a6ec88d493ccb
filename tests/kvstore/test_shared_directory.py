"""The shared KV tier's directory (kvstore.shared_directory) and a replica's mirror of it
(kvstore.shared_mirror): capacity in bytes, LRU order, leases, a leaving owner's blocks, the
version a mirror polls, and the SHARED-medium events the mirror tells."""

from __future__ import annotations

import pytest

from engine.kv_cache.events import SHARED, BlockRemoved, BlockStored
from kvstore.shared_directory import SharedBlock, SharedDirectory
from kvstore.shared_mirror import SharedIndex


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _block(owner: str = "A", nbytes: int = 100) -> SharedBlock:
    return SharedBlock(["ref"], nbytes, 7, (2, 2), "torch.float32", owner, 0.0)


def _dir(capacity: int = 300, lease_s: float = 60.0):
    clock = FakeClock()
    return SharedDirectory(capacity, lease_s, clock), clock


def test_full_directory_evicts_least_recently_used_first():
    d, _ = _dir(capacity=300)
    for h in (b"a", b"b", b"c"):
        assert d.put(h, _block()) == []
    d.get([b"a"])  # a is used again: b is now the oldest
    assert d.put(b"d", _block()) == [b"b"]
    assert set(d.keys()) == {b"a", b"c", b"d"}
    assert d.bytes_held == 300 and d.counts["evicted"] == 1


def test_block_larger_than_the_whole_tier_is_never_held():
    d, _ = _dir(capacity=300)
    d.put(b"a", _block())
    assert d.put(b"huge", _block(nbytes=301)) == []
    assert b"huge" not in d and b"a" in d and d.counts["too_big"] == 1


def test_a_block_held_keeps_its_first_copy():
    d, _ = _dir()
    d.put(b"a", _block(owner="A"))
    version = d.version
    d.put(b"a", _block(owner="B"))
    assert d.get([b"a"])[0].owner == "A"
    assert d.version == version and d.counts["duplicates"] == 1


def test_get_reports_misses_as_none():
    d, _ = _dir()
    d.put(b"a", _block())
    assert [b is not None for b in d.get([b"a", b"x"])] == [True, False]
    assert d.counts["hits"] == 1 and d.counts["misses"] == 1


def test_a_leaving_owner_takes_its_blocks_with_it():
    d, _ = _dir(capacity=1000)
    d.put(b"a", _block(owner="A"))
    d.put(b"b", _block(owner="B"))
    d.put(b"c", _block(owner="A"))
    assert sorted(d.drop_owner("A")) == [b"a", b"c"]
    assert d.keys() == [b"b"] and d.bytes_held == 100


def test_unused_blocks_expire_when_their_lease_passes_and_a_hit_renews_it():
    d, clock = _dir(lease_s=60.0)
    d.put(b"a", _block())
    d.put(b"b", _block())
    clock.now += 50
    d.get([b"a"])
    clock.now += 20
    assert d.sweep() == [b"b"]
    assert b"a" in d and d.counts["expired"] == 1


def test_version_changes_with_the_key_set_only():
    d, _ = _dir()
    assert d.changes_since(d.version) is None
    v0 = d.version
    d.put(b"a", _block())
    assert d.changes_since(v0) == {"version": d.version, "added": [b"a"], "removed": []}
    v1 = d.version
    d.get([b"a"])  # a hit reorders, the key set stays
    assert d.changes_since(v1) is None
    d.drop([b"a"])
    assert d.changes_since(v1) == {"version": d.version, "added": [], "removed": [b"a"]}
    assert d.drop([b"a"]) == [] and d.changes_since(d.version) is None


def test_changes_since_a_version_give_each_block_its_last_change():
    d, _ = _dir(capacity=200)
    v0 = d.version
    d.put(b"a", _block())
    d.put(b"b", _block())
    d.drop([b"a"])
    d.put(b"c", _block())  # evicts nothing: a is gone
    d.put(b"a", _block())  # evicts b
    changes = d.changes_since(v0)
    assert sorted(changes["added"]) == [b"a", b"c"] and changes["removed"] == [b"b"]


def test_a_mirror_behind_the_change_log_gets_the_whole_key_set():
    d = SharedDirectory(10_000, 60.0, FakeClock(), log_len=2)
    for h in (b"a", b"b", b"c"):
        d.put(h, _block())
    assert d.changes_since(0) == {"version": 3, "keys": [b"a", b"b", b"c"]}
    delta = d.changes_since(1)
    assert delta["version"] == 3 and sorted(delta["added"]) == [b"b", b"c"] and delta["removed"] == []
    assert d.changes_since(-1)["keys"] == [b"a", b"b", b"c"]  # a fresh mirror


@pytest.mark.parametrize("capacity, lease_s", [(0, 1.0), (10, 0.0)])
def test_directory_refuses_a_nonsense_size_or_lease(capacity, lease_s):
    with pytest.raises(ValueError):
        SharedDirectory(capacity, lease_s)


def test_mirror_offers_only_what_the_directory_listed_and_tells_the_changes():
    index = SharedIndex(block_size=16)
    index.add(b"mine", None)  # stored here, not listed yet
    assert b"mine" in index and index.prefix_hits([b"mine"], 0, 1) == 0
    index.refresh(1, [b"mine", b"theirs"])
    assert index.prefix_hits([b"mine", b"theirs", b"x"], 0, 3) == 2
    [stored] = index.take_events()
    assert isinstance(stored, BlockStored) and stored.medium == SHARED
    assert set(stored.block_hashes) == {b"mine", b"theirs"} and stored.num_tokens == 32
    index.refresh(2, [b"theirs"])
    assert index.take_events() == [BlockRemoved((b"mine",), SHARED)]
    assert index.version == 2 and index.hashes() == (b"theirs",)


def test_mirror_follows_the_directory_through_deltas_and_whole_sets():
    d, _ = _dir(capacity=1000)
    index = SharedIndex(block_size=16)
    index.apply(d.changes_since(index.version))  # a fresh mirror: the whole set
    d.put(b"a", _block())
    d.put(b"b", _block())
    index.apply(d.changes_since(index.version))
    d.drop([b"a"])
    d.put(b"c", _block())
    index.apply(d.changes_since(index.version))
    assert set(index.hashes()) == set(d.keys()) == {b"b", b"c"} and index.version == d.version
    assert d.changes_since(index.version) is None


def test_mirror_stops_offering_a_block_whose_load_failed():
    index = SharedIndex(block_size=16)
    index.refresh(1, [b"a", b"b"])
    index.take_events()
    assert index.remove([b"a"]) == []  # nothing for a worker to evict: the directory decides
    assert index.prefix_hits([b"a", b"b"], 0, 2) == 0
