"""--router-mode kv in cluster.replica.router: replicas' cached prefix blocks (the compact
digest their routing stats carry, cluster.replica.kv_digest) decide, load counted; a stale or
missing digest falls back to load; the other modes; AppConfig's flags (no Ray, no Serve app)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from cluster.replica.kv_digest import KVDigest
from cluster.replica.router import LeastLoadRouter
from cluster.replica.router_stats import DECISIONS
from engine.errors import ParameterError
from engine.kv_cache.events import KVSnapshot
from engine.kv_cache.kv_routing import prompt_block_hashes
from tests.cluster.helpers import engine_request
from tests.cluster.test_router import FakeReplica, _names

BLOCK = 16
PROMPT = list(range(3, 3 + 6 * BLOCK + 5))  # 6 full blocks


def _with_kv(replica: FakeReplica, seq: int, device=(), host=()) -> FakeReplica:
    digest = KVDigest(BLOCK).of(KVSnapshot(seq, {"device": tuple(device), "host": tuple(host)}))
    replica.routing_stats = {**replica.routing_stats, "kv": digest}
    return replica


def _router(replicas, **kwargs) -> LeastLoadRouter:
    router = object.__new__(LeastLoadRouter)
    router.initialize_state(router_mode="kv", **kwargs)
    router._replicas = {r.replica_id: r for r in replicas}
    router._rng = None  # ties in the given order, so orders can be asserted
    return router


def _choose(router, replicas, prompt=PROMPT):
    pending = SimpleNamespace(args=[engine_request("r", prompt)], kwargs={})
    return _names(asyncio.run(router.choose_replicas(replicas, pending)))


HASHES = prompt_block_hashes(PROMPT, BLOCK)


def test_the_replica_holding_the_prefix_wins_until_its_load_outweighs_the_blocks_saved():
    a = _with_kv(FakeReplica("a", running=3), 1, device=HASHES[:5])
    b = _with_kv(FakeReplica("b"), 1)
    assert _choose(_router([a, b]), [a, b]) == ["a", "b"]  # 6 - 5 + 3 = 4 against 6 + 0
    a.routing_stats["running"] = 6  # 1 + 6 = 7 against 6: the idle one
    assert _choose(_router([a, b]), [a, b]) == ["b", "a"]
    # The weight trades blocks against load.
    assert _choose(_router([a, b], kv_overlap_score_weight=3.0), [a, b]) == ["a", "b"]


def test_a_longer_prefix_beats_a_shorter_one_and_only_a_prefix_counts():
    a = _with_kv(FakeReplica("a"), 1, device=HASHES[:2])
    b = _with_kv(FakeReplica("b"), 1, device=HASHES[:4])
    c = _with_kv(FakeReplica("c"), 1, device=HASHES[1:6])  # no first block: nothing usable
    assert _choose(_router([a, b, c]), [c, a, b]) == ["b", "a", "c"]


def test_host_tier_blocks_count_but_cost_more_than_device_ones():
    a = _with_kv(FakeReplica("a"), 1, host=HASHES[:4])
    b = _with_kv(FakeReplica("b"), 1, device=HASHES[:4])
    c = _with_kv(FakeReplica("c"), 1)
    assert _choose(_router([a, b, c]), [c, a, b]) == ["b", "a", "c"]


def test_a_new_digest_replaces_the_old_one_and_a_departed_replica_is_forgotten():
    a = _with_kv(FakeReplica("a"), 1, device=HASHES)
    b = _with_kv(FakeReplica("b"), 1)
    router = _router([a, b])
    assert _choose(router, [b, a]) == ["a", "b"]
    _with_kv(a, 2)  # a evicted everything, b now holds the prompt
    _with_kv(b, 2, device=HASHES)
    assert _choose(router, [a, b]) == ["b", "a"]
    _choose(router, [b])
    assert router._kv_index.sources() == ["b"]


def test_without_digests_or_for_an_adapter_the_load_decides():
    a, b = FakeReplica("a", running=2), FakeReplica("b", running=1)
    before = DECISIONS[("", "load")]
    assert _choose(_router([a, b]), [a, b]) == ["b", "a"]
    assert DECISIONS[("", "load")] == before + 1
    _with_kv(a, 1, device=HASHES)
    before = DECISIONS[("", "kv_overlap")]
    assert _choose(_router([a, b]), [a, b]) == ["a", "b"]
    assert DECISIONS[("", "kv_overlap")] == before + 1
    lora = SimpleNamespace(args=[engine_request("r", PROMPT, lora_request=SimpleNamespace(lora_name="x"))],
                           kwargs={})
    router = _router([a, b])
    ranked = _names(asyncio.run(router.choose_replicas([a, b], lora)))
    assert ranked[0] in ("a", "b") and DECISIONS[("", "lora")] >= 1


def test_round_robin_cycles_and_a_bad_mode_is_refused():
    reps = [FakeReplica(k, running=r) for k, r in (("a", 5), ("b", 0), ("c", 9))]
    router = _router(reps)
    router._mode = "round-robin"
    firsts = [_choose(router, reps)[0] for _ in range(6)]
    assert sorted(firsts[:3]) == ["a", "b", "c"] and firsts[3:] == firsts[:3]
    with pytest.raises(ValueError, match="router_mode must be one of"):
        object.__new__(LeastLoadRouter).initialize_state(router_mode="fastest")


def test_the_digest_is_packed_again_only_when_the_engine_moved():
    digest = KVDigest(BLOCK)
    first = digest.of(KVSnapshot(3, {"device": tuple(HASHES)}))
    assert digest.of(KVSnapshot(3, {"device": ()})) is first
    assert len(first["device"]) == 8 * len(HASHES) and digest.counts["device"] == len(HASHES)
    assert digest.of(KVSnapshot(4, {"device": ()}))["device"] == b""
    assert digest.of(None) is None


def test_app_config_router_flags(tiny_model):
    from cluster.roles import Role
    from tests.cluster.helpers import tiny_app

    pd = tiny_app(tiny_model, "pd", "m", "a", router_mode="kv")
    assert pd.router_kwargs() == {"router_mode": "kv", "kv_overlap_score_weight": 1.0}
    on = [pd.role_engine_args(r).create_engine_config().cache.enable_kv_cache_events for r in (Role.PREFILL,
                                                                                             Role.DECODE)]
    assert on == [True, False]
    colocated = tiny_app(tiny_model, "colocated", "m", "a", router_mode="kv")
    assert not colocated.direct  # its router must stand between the ingress and the engines
    assert colocated.role_engine_args(Role.COLOCATED).create_engine_config().cache.enable_kv_cache_events
    assert tiny_app(tiny_model, "colocated", "m", "a", prefix_affinity=True).resolved_router_mode == "prefix-affinity"
    for fields, field in (({"router_mode": "fastest"}, "router_mode"),
                          ({"router_mode": "kv", "prefix_affinity": True}, "router_mode"),
                          ({"kv_overlap_score_weight": -1.0}, "kv_overlap_score_weight")):
        with pytest.raises(ParameterError) as e:
            tiny_app(tiny_model, "colocated", "m", "a", **fields)
        assert e.value.field == field


def test_a_prompt_just_sent_counts_as_held_there_until_its_prediction_expires(monkeypatch):
    import engine.kv_cache.prefix_index as prefix_index

    a, b = _with_kv(FakeReplica("a"), 1), _with_kv(FakeReplica("b", running=1), 1)
    router = _router([a, b])
    pending = SimpleNamespace(args=[engine_request("r1", PROMPT)], kwargs={})
    assert _names(asyncio.run(router.choose_replicas([a, b], pending))) == ["a", "b"]
    router.on_request_routed(pending, b.replica_id, None)  # Serve sent it to b after all
    # A next turn before b reports: b, though busier; a new digest of b does not drop it.
    _with_kv(b, 2)
    assert _choose(router, [a, b], PROMPT + [5, 6]) == ["b", "a"]
    now = prefix_index.time.monotonic()
    monkeypatch.setattr(prefix_index.time, "monotonic", lambda: now + 11.0)
    assert _choose(router, [a, b], PROMPT + [5, 6]) == ["a", "b"]
