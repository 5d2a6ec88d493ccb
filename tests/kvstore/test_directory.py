"""The transfer directory: leases, capacity, release, stats."""

from __future__ import annotations

import pytest

from kvstore.directory import StoreFullError, TransferDirectory


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _dir(**kw):
    clock = FakeClock()
    return TransferDirectory(clock=clock, **kw), clock


def test_put_lookup_release_round_trip():
    d, _ = _dir()
    d.put("t1", "prefill-0", 100, 7, location="ref")
    assert d.lookup("t1").location == "ref" and d.lookup("t1").num_tokens == 7
    assert d.stats().live_transfers == 1 and d.stats().live_bytes == 100
    assert d.release("t1").transfer_id == "t1"
    assert d.lookup("t1") is None and d.stats().live_bytes == 0
    assert d.release("t1") is None  # releasing twice is harmless


def test_duplicate_transfer_id_is_rejected():
    d, _ = _dir()
    d.put("t1", "p", 1, 1, None)
    with pytest.raises(ValueError, match="already registered"):
        d.put("t1", "p", 1, 1, None)


def test_lease_expiry_frees_unclaimed_transfers_only_after_deadline():
    d, clock = _dir(lease_s=120.0)
    d.put("old", "p", 10, 1, None)
    clock.now += 60
    d.put("new", "p", 20, 1, None)
    clock.now += 59.9
    assert d.sweep() == []
    clock.now += 0.2
    assert [e.transfer_id for e in d.sweep()] == ["old"]
    assert d.stats().live_transfers == 1 and d.stats().live_bytes == 20 and d.stats().expired == 1


def test_per_transfer_lease_overrides_default():
    d, clock = _dir(lease_s=120.0)
    d.put("short", "p", 1, 1, None, lease_s=1.0)
    clock.now += 1.0
    assert [e.transfer_id for e in d.sweep()] == ["short"]


def test_capacity_in_bytes_fails_clearly_and_leaves_state_unchanged():
    d, _ = _dir(max_bytes=100)
    d.put("a", "p", 60, 1, None)
    with pytest.raises(StoreFullError, match="max_bytes=100"):
        d.put("b", "p", 50, 1, None)
    assert d.stats().live_bytes == 60 and d.stats().rejected_full == 1
    d.release("a")
    d.put("b", "p", 50, 1, None)


def test_capacity_in_transfers_fails_clearly():
    d, _ = _dir(max_transfers=1)
    d.put("a", "p", 1, 1, None)
    with pytest.raises(StoreFullError, match="max_transfers=1"):
        d.put("b", "p", 1, 1, None)


def test_release_owner_drops_all_of_a_producers_transfers():
    d, _ = _dir()
    d.put("a", "p0", 1, 1, None)
    d.put("b", "p1", 2, 1, None)
    d.put("c", "p0", 3, 1, None)
    assert sorted(e.transfer_id for e in d.release_owner("p0")) == ["a", "c"]
    assert d.stats().live_transfers == 1


def test_invalid_lease_is_rejected():
    with pytest.raises(ValueError, match="lease_s"):
        TransferDirectory(lease_s=0)


def test_a_release_before_registration_refuses_the_late_registration():
    """The requester gave up (and released the id it chose) while the producer was still
    exporting: the late registration is refused, so nothing waits for the lease."""
    d, clock = _dir(lease_s=120.0)
    assert d.release("late") is None
    with pytest.raises(ValueError, match="released before it was registered"):
        d.put("late", "p", 10, 1, None)
    assert d.stats().live_transfers == 0
    d.put("late", "p", 10, 1, None)  # the tombstone is used up by the refusal
    d.release("late")


def test_tombstones_expire():
    d, clock = _dir(lease_s=120.0)
    d.release("gone")
    clock.now += 61.0
    d.sweep()
    d.put("gone", "p", 1, 1, None)  # an old tombstone no longer refuses anything
    assert d.lookup("gone") is not None


def test_releasing_a_transfer_releases_its_rank_shards_and_closes_late_ones():
    from kvstore.shards import shard_transfer_id

    d, _ = _dir()
    d.put(shard_transfer_id("t", 0), "prefill-0.rank0", 10, 4, location="r0")
    d.put("t2", "prefill-0", 10, 4, location="other")
    assert d.count_owned("prefill-0") == 2  # a rank's shards count for its replica
    released = d.release_with_shards("t")
    assert [e.transfer_id for e in released] == [shard_transfer_id("t", 0)]
    assert d.lookup("t2") is not None  # not a shard of "t"
    with pytest.raises(ValueError, match="was released before its shard"):
        d.put(shard_transfer_id("t", 1), "prefill-0.rank1", 10, 4, location="r1")
    assert d.is_closed(shard_transfer_id("t", 1))


def test_a_released_or_expired_transfer_is_closed_so_lookups_need_not_wait():
    """A consumer that looks up a transfer released or expired before it came (its lease ran
    out, or a peer released it) learns at once that it is gone: the store waits for a
    registration only while the id is not closed (kvstore.store_actor.lookup)."""
    d, clock = _dir(lease_s=10.0)
    d.put("claimed", "p", 1, 1, None)
    d.put("unclaimed", "p", 1, 1, None)
    d.release("claimed")
    assert d.is_closed("claimed") and not d.is_closed("unclaimed")
    clock.now += 10.0
    assert [e.transfer_id for e in d.sweep()] == ["unclaimed"]
    assert d.is_closed("unclaimed")
    with pytest.raises(ValueError, match="released"):
        d.put("unclaimed", "p", 1, 1, None)  # a producer's late retry cannot bring it back
    clock.now += 61.0
    d.sweep()
    assert not d.is_closed("claimed")  # closed ids are forgotten after the tombstone TTL


def test_a_lookup_of_a_released_transfer_answers_without_waiting(ray_local):
    """At the store actor: a lookup with a long registration wait returns None for a released
    transfer instead of waiting it out (it waited the whole 10 s before)."""
    from kvstore.store_actor import create_store

    store = create_store()
    try:
        # `refs`: bytes the producer already put (so the store asks no producer for them).
        ray_local.get(store.register.remote("t", "p", None, 1, 1, refs=[ray_local.put(b"kv")]))
        ray_local.get(store.release.remote("t"))
        # The wait is 1 h, the call's bound 60 s: only a store that knows "t" is closed answers.
        assert ray_local.get(store.lookup.remote("t", 3600.0), timeout=60) is None
    finally:
        ray_local.kill(store)
