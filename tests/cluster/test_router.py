"""cluster.replica.router: the load formula, ranking, prefix affinity and the Serve router's
bookkeeping of requests sent between two replica reports (no Ray, no Serve app)."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from cluster.replica.router import Candidate, LeastLoadRouter, affinity_key, rank
from tests.cluster.helpers import engine_request

REPLICAS = [f"replica-{i}" for i in range(5)]


def _idle(keys):
    return [Candidate(k, running=0, waiting=0) for k in keys]


def _home(keys, affinity) -> str:
    """The home replica of `affinity` among `keys`: with equal loads it always goes first."""
    return rank(_idle(keys), affinity)[0]


# --- Candidate.load ------------------------------------------------------------------------


@pytest.mark.parametrize("running, waiting, sent, expected", [
    (0, 0, 0, 0),
    (3, 0, 0, 3),
    (0, 2, 0, 8),
    (0, 0, 1, 4),
    (3, 2, 1, 4 * (2 + 1) + 3),
    (7, 5, 0, 27),
])
def test_candidate_load_weights_waiting_and_sent(running, waiting, sent, expected):
    assert Candidate("r", running=running, waiting=waiting, sent_since_report=sent).load == expected


def test_sent_since_report_defaults_to_zero():
    assert Candidate("r", running=2, waiting=1).load == 6


# --- rank: least load ------------------------------------------------------------------------


def test_rank_orders_by_least_load():
    cands = [
        Candidate("a", running=5, waiting=0),                       # 5
        Candidate("b", running=0, waiting=1),                       # 4
        Candidate("c", running=9, waiting=0),                       # 9
        Candidate("d", running=2, waiting=0),                       # 2
        Candidate("e", running=0, waiting=0, sent_since_report=2),  # 8
    ]
    assert rank(cands) == ["d", "b", "a", "e", "c"]


def test_rank_one_waiting_outweighs_three_running():
    cands = [Candidate("w", running=0, waiting=1), Candidate("r", running=3, waiting=0)]
    assert rank(cands) == ["r", "w"]
    cands = [Candidate("w", running=0, waiting=1), Candidate("r", running=5, waiting=0)]
    assert rank(cands) == ["w", "r"]


def test_rank_ties_broken_by_key_whatever_the_input_order():
    # x, y and z all have load 4; m has load 1
    cands = [Candidate("z", 4, 0), Candidate("x", 0, 1), Candidate("m", 1, 0), Candidate("y", 0, 0, 1)]
    expected = ["m", "x", "y", "z"]
    for perm in itertools.permutations(cands):
        assert rank(list(perm)) == expected


def test_rank_empty():
    assert rank([]) == []
    assert rank([], affinity="k") == []


def test_rank_returns_every_candidate_once_with_affinity():
    cands = [Candidate(k, running=i, waiting=0) for i, k in enumerate(REPLICAS)]
    for i in range(20):
        out = rank(cands, affinity=f"key-{i}")
        assert sorted(out) == sorted(REPLICAS)


# --- rank: affinity ---------------------------------------------------------------------------


def test_home_is_the_highest_rendezvous_hash():
    # rendezvous hash: SHA-1 of "<affinity key>|<replica key>", first 8 bytes, big-endian;
    # computed here independently so every router (and every version) agrees on homes
    def score(key, replica):
        return int.from_bytes(hashlib.sha1(f"{key}|{replica}".encode()).digest()[:8], "big")

    for i in range(50):
        key = affinity_key([i, i + 1, i + 2], 3)
        expected = max(REPLICAS, key=lambda r: score(key, r))
        assert _home(REPLICAS, key) == expected


def test_home_replica_is_independent_of_input_order():
    for i in range(20):
        key = f"key-{i}"
        homes = {_home(list(perm), key) for perm in itertools.permutations(REPLICAS[:4])}
        assert len(homes) == 1


def test_home_first_when_within_slack_then_rest_by_least_load():
    key = "some-prefix"
    home = _home(REPLICAS, key)
    others = [k for k in REPLICAS if k != home]
    slack = 8
    # others at loads 1, 2, 3, 4; home at min + slack exactly
    cands = [Candidate(k, running=i + 1, waiting=0) for i, k in enumerate(others)]
    cands.append(Candidate(home, running=1 + slack, waiting=0))
    assert rank(cands, key, affinity_slack=slack) == [home] + others


def test_home_not_first_when_beyond_slack():
    key = "some-prefix"
    home = _home(REPLICAS, key)
    others = [k for k in REPLICAS if k != home]
    slack = 8
    cands = [Candidate(k, running=i + 1, waiting=0) for i, k in enumerate(others)]
    cands.append(Candidate(home, running=1 + slack + 1, waiting=0))  # load 10 > 1 + 8
    # pure least-load order: others (loads 1..4) then home (10)
    assert rank(cands, key, affinity_slack=slack) == others + [home]
    # and a home between others in load keeps its least-load place
    cands = [Candidate(others[0], 0, 0), Candidate(others[1], 0, 1), Candidate(home, 2, 0),
             Candidate(others[2], 0, 2)]
    assert rank(cands, key, affinity_slack=1) == [others[0], home, others[1], others[2]]


def test_slack_zero_needs_home_at_least_load():
    key = "k0"
    home = _home(REPLICAS[:3], key)
    a, b = [k for k in REPLICAS[:3] if k != home]
    tied = [Candidate(a, 2, 0), Candidate(b, 3, 0), Candidate(home, 2, 0)]
    assert rank(tied, key, affinity_slack=0)[0] == home
    busier = [Candidate(a, 2, 0), Candidate(b, 3, 0), Candidate(home, 3, 0)]
    assert rank(busier, key, affinity_slack=0) == [a] + sorted([b, home])


def test_no_affinity_key_means_pure_least_load():
    cands = [Candidate(k, running=i, waiting=0) for i, k in enumerate(reversed(REPLICAS))]
    assert rank(cands, None) == list(reversed(REPLICAS))


def test_home_survives_removal_of_other_replicas():
    keys = [f"prefix-{i}" for i in range(300)]
    for key in keys:
        home = _home(REPLICAS, key)
        for gone in REPLICAS:
            if gone == home:
                continue
            remaining = [k for k in REPLICAS if k != gone]
            assert _home(remaining, key) == home, (key, gone)


def test_adding_a_replica_moves_keys_only_to_it():
    keys = [f"prefix-{i}" for i in range(300)]
    moved = 0
    for key in keys:
        before = _home(REPLICAS[:4], key)
        after = _home(REPLICAS, key)
        if after != before:
            assert after == REPLICAS[4], key
            moved += 1
    # some, but far from all, keys move to the new replica (about 1/5 expected)
    assert 0 < moved < len(keys) // 2


def test_removing_home_moves_its_keys_elsewhere_and_back():
    for i in range(50):
        key = f"prefix-{i}"
        home = _home(REPLICAS, key)
        remaining = [k for k in REPLICAS if k != home]
        new_home = _home(remaining, key)
        assert new_home in remaining
        assert _home(remaining + [home], key) == home


def test_keys_spread_over_replicas():
    keys = [affinity_key(list(range(i, i + 32)), 32) for i in range(400)]
    counts = Counter(_home(REPLICAS, key) for key in keys)
    assert set(counts) == set(REPLICAS)
    # about 80 each; no replica gets fewer than a quarter or more than twice its share
    assert min(counts.values()) >= 20
    assert max(counts.values()) <= 160


# --- affinity_key -----------------------------------------------------------------------------


def test_affinity_key_none_for_short_or_missing_prompts():
    assert affinity_key(None, 4) is None
    assert affinity_key([], 4) is None
    assert affinity_key([1, 2, 3], 4) is None


def test_affinity_key_for_prompt_of_exactly_prefix_tokens():
    key = affinity_key([1, 2, 3, 4], 4)
    assert isinstance(key, str) and key


def test_affinity_key_depends_only_on_the_prefix():
    a = affinity_key([1, 2, 3, 4, 5, 6], 4)
    b = affinity_key([1, 2, 3, 4, 99, 100, 101], 4)
    c = affinity_key([1, 2, 3, 4], 4)
    assert a == b == c


def test_affinity_key_differs_when_prefix_differs():
    base = [10, 20, 30, 40, 50]
    keys = {affinity_key(base, 4)}
    for pos in range(4):
        changed = list(base)
        changed[pos] += 1
        keys.add(affinity_key(changed, 4))
    assert len(keys) == 5
    # token boundaries matter: [1, 23] and [12, 3] are different prompts
    assert affinity_key([1, 23], 2) != affinity_key([12, 3], 2)


# --- LeastLoadRouter without Serve ------------------------------------------------------------


@dataclass(frozen=True)
class FakeReplicaID:
    unique_id: str


class FakeReplica:
    def __init__(self, name: str, running: int = 0, waiting: int = 0, seq: int | None = 0):
        self.replica_id = FakeReplicaID(name)
        self.routing_stats = {"running": running, "waiting": waiting, "seq": seq}

    def __repr__(self) -> str:
        return f"FakeReplica({self.replica_id.unique_id})"


def _router(replicas, random_ties: bool = False, **kwargs) -> LeastLoadRouter:
    router = object.__new__(LeastLoadRouter)
    router.initialize_state(**kwargs)
    router._replicas = {r.replica_id: r for r in replicas}
    if not random_ties:
        router._rng = None  # ties by key, so orders can be asserted
    return router


def _choose(router, replicas, pending=None):
    return asyncio.run(router.choose_replicas(replicas, pending))


def _names(ranks):
    assert all(len(group) == 1 for group in ranks)
    return [group[0].replica_id.unique_id for group in ranks]


def _pending(token_ids):
    return SimpleNamespace(args=[engine_request("r", token_ids)], kwargs={})


def test_choose_replicas_one_per_rank_in_least_load_order():
    reps = [FakeReplica("a", running=5), FakeReplica("b", waiting=1), FakeReplica("c", running=2),
            FakeReplica("d", running=4)]  # loads 5, 4, 2, 4
    router = _router(reps)
    ranks = _choose(router, reps)
    assert _names(ranks) == ["c", "b", "d", "a"]
    # the very replica objects are returned
    by_name = {r.replica_id.unique_id: r for r in reps}
    assert all(group[0] is by_name[name] for group, name in zip(ranks, _names(ranks)))


def test_choose_replicas_only_among_candidates():
    reps = [FakeReplica("a", running=5), FakeReplica("b", running=1), FakeReplica("c", running=0)]
    router = _router(reps)
    assert _names(_choose(router, reps[:2])) == ["b", "a"]


def test_replicas_to_avoid_are_passed_over_unless_no_other_is_left():
    reps = [FakeReplica("a", running=0), FakeReplica("b", running=3), FakeReplica("c", running=5)]
    router = _router(reps)
    avoid = SimpleNamespace(args=[engine_request("r", [1, 2])], kwargs={"avoid": ["a"]})
    assert _names(_choose(router, reps, avoid)) == ["b", "c"]
    everywhere = SimpleNamespace(args=[engine_request("r", [1, 2])], kwargs={"avoid": ["a", "b", "c"]})
    assert _names(_choose(router, reps, everywhere)) == ["a", "b", "c"]


def test_replica_without_stats_counts_as_idle():
    reps = [FakeReplica("a", running=1), FakeReplica("b", running=3)]
    reps[1].routing_stats = {}
    empty = FakeReplica("c")
    empty.routing_stats = None
    reps.append(empty)
    router = _router(reps)
    # loads: a 1, b 0 (empty stats), c 0 (no stats)
    assert _names(_choose(router, reps)) == ["b", "c", "a"]


def test_routed_requests_count_as_waiting_until_next_report():
    a, b = FakeReplica("a", running=0, seq=1), FakeReplica("b", running=5, seq=7)
    router = _router([a, b])
    assert _names(_choose(router, [a, b])) == ["a", "b"]           # 0 vs 5
    router.on_request_routed(_pending([1]), a.replica_id, None)
    assert _names(_choose(router, [a, b])) == ["a", "b"]           # 4 vs 5
    router.on_request_routed(_pending([1]), a.replica_id, None)
    assert _names(_choose(router, [a, b])) == ["b", "a"]           # 8 vs 5
    # a reports again (new seq): its figures now include what was sent, the count resets
    a.routing_stats = {"running": 0, "waiting": 0, "seq": 2}
    assert _names(_choose(router, [a, b])) == ["a", "b"]           # 0 vs 5


def test_sent_count_restarts_from_one_after_a_report():
    a, b = FakeReplica("a", running=0, seq=1), FakeReplica("b", running=5, seq=1)
    router = _router([a, b])
    router.on_request_routed(_pending([1]), a.replica_id, None)     # 1 sent under seq 1
    a.routing_stats = {"running": 0, "waiting": 0, "seq": 2}
    router.on_request_routed(_pending([1]), a.replica_id, None)     # 1 sent under seq 2
    assert _names(_choose(router, [a, b])) == ["a", "b"]           # 4 vs 5 (not 8 vs 5)
    router.on_request_routed(_pending([1]), a.replica_id, None)     # 2 sent under seq 2
    assert _names(_choose(router, [a, b])) == ["b", "a"]           # 8 vs 5


def test_sent_counts_are_per_replica():
    a, b, c = (FakeReplica("a", running=0), FakeReplica("b", running=1), FakeReplica("c", running=6))
    router = _router([a, b, c])
    router.on_request_routed(_pending([1]), a.replica_id, None)     # a: 4
    assert _names(_choose(router, [a, b, c])) == ["b", "a", "c"]
    router.on_request_routed(_pending([1]), b.replica_id, None)     # b: 5
    assert _names(_choose(router, [a, b, c])) == ["a", "b", "c"]
    router.on_request_routed(_pending([1]), a.replica_id, None)     # a: 8
    assert _names(_choose(router, [a, b, c])) == ["b", "c", "a"]


def test_router_affinity_sends_prefix_home_within_slack():
    prefix = list(range(100, 104))
    names = ["a", "b", "c", "d"]
    home = _home(names, affinity_key(prefix + [1], 4))
    others = [n for n in names if n != home]
    reps = [FakeReplica(n, running=0) for n in others] + [FakeReplica(home, running=3)]
    router = _router(reps, prefix_affinity=True, affinity_prefix_tokens=4, affinity_slack=3)
    assert _names(_choose(router, reps, _pending(prefix + [1, 2])))[0] == home
    # another prompt with the same first 4 tokens goes to the same home
    assert _names(_choose(router, reps, _pending(prefix + [9, 9, 9])))[0] == home
    # beyond the slack, least load wins
    reps[-1].routing_stats["running"] = 4
    assert _names(_choose(router, reps, _pending(prefix + [1, 2]))) == sorted(others) + [home]


def test_router_affinity_off_or_not_applicable_is_least_load():
    prefix = list(range(100, 104))
    names = ["a", "b", "c", "d"]
    home = _home(names, affinity_key(prefix, 4))
    others = [n for n in names if n != home]
    reps = [FakeReplica(n, running=0) for n in others] + [FakeReplica(home, running=1)]
    expected = sorted(others) + [home]
    off = _router(reps, prefix_affinity=False, affinity_prefix_tokens=4, affinity_slack=8)
    assert _names(_choose(off, reps, _pending(prefix))) == expected
    on = _router(reps, prefix_affinity=True, affinity_prefix_tokens=4, affinity_slack=8)
    assert _names(_choose(on, reps, _pending(prefix)))[0] == home
    # too short a prompt, a text prompt, no request, no args: no affinity
    assert _names(_choose(on, reps, _pending(prefix[:3]))) == expected
    assert _names(_choose(on, reps, SimpleNamespace(args=["text prompt"], kwargs={}))) == expected
    assert _names(_choose(on, reps, None)) == expected
    assert _names(_choose(on, reps, SimpleNamespace(args=[], kwargs={}))) == expected


def test_equal_loads_are_shared_in_random_order():
    """Idle replicas must all get light traffic (a fixed tie order would send every lone
    request to the same replica)."""
    replicas = [FakeReplica(k, running=0, waiting=0, seq=1) for k in "abc"]
    router = _router(replicas, random_ties=True)
    firsts = {_choose(router, replicas)[0][0].replica_id.unique_id for _ in range(60)}
    assert firsts == {"a", "b", "c"}


# --- LoRA affinity ----------------------------------------------------------------------------


def _lora_pending(name: str, token_ids=(1, 2, 3)):
    from engine.lora import LoRARequest

    return SimpleNamespace(args=[engine_request("r", list(token_ids),
                                                lora_request=LoRARequest(name, 1, f"/adapters/{name}"))], kwargs={})


def test_router_sends_an_adapter_to_a_replica_that_holds_it_within_slack():
    reps = [FakeReplica(n, running=0) for n in "abc"] + [FakeReplica("d", running=3)]
    reps[-1].routing_stats["loras"] = ["sql", "chat"]
    router = _router(reps, affinity_slack=3)
    assert _names(_choose(router, reps, _lora_pending("sql")))[0] == "d"
    # a request of the base model, or of an adapter nobody holds, is not drawn to d
    assert _names(_choose(router, reps, _pending([1, 2, 3])))[-1] == "d"
    reps[-1].routing_stats["running"] = 4  # beyond the slack: least load wins
    assert _names(_choose(router, reps, _lora_pending("sql"))) == ["a", "b", "c", "d"]


def test_the_least_loaded_holder_wins_and_an_unheld_adapter_has_a_stable_home():
    cands = [Candidate("a", 0, 0), Candidate("b", 2, 0, loras=frozenset({"x"})),
             Candidate("c", 1, 0, loras=frozenset({"x"}))]
    assert rank(cands, lora="x")[0] == "c"
    homes = {rank(list(p), lora="y")[0] for p in itertools.permutations(_idle(REPLICAS[:4]))}
    assert len(homes) == 1
    # different adapters spread over replicas instead of piling onto one
    assert len({rank(_idle(REPLICAS), lora=f"adapter-{i}")[0] for i in range(20)}) > 1
