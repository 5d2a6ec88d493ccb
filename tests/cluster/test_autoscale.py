"""The autoscaling policy on recorded/synthetic metric traces (deterministic, no Ray)."""

from __future__ import annotations

import pytest

from cluster.control.autoscale import AutoscaleConfig, PolicyState, RoleSignal, decide

CFG = AutoscaleConfig(enabled=True, ttft_p90_target_s=1.0, itl_p90_target_s=0.1, up_ticks=2, down_ticks=5,
                      cooldown_ticks=3, min_replicas={"prefill": 1, "decode": 1},
                      max_replicas={"prefill": 4, "decode": 4})


def simulate(load_trace, cfg=CFG, start=1, model=None):
    """Closed loop: the TTFT a prefill pool shows for `load` (requests in flight) falls as
    replicas are added; returns the replica count after each tick and the ticks of changes."""
    model = model or (lambda load, n: RoleSignal(replicas=n, waiting=max(0, load - 4 * n),
                                                 ttft_p90_s=0.3 * load / n))
    state, n, counts, changes = PolicyState(), start, [], []
    for tick, load in enumerate(load_trace):
        state, out = decide(cfg, state, {"prefill": model(load, n)})
        if "prefill" in out:
            assert abs(out["prefill"] - n) == 1  # one step at a time
            n = out["prefill"]
            changes.append(tick)
        counts.append(n)
    return counts, changes


def test_follows_a_load_step_up_and_down_without_flapping():
    trace = [1] * 10 + [10] * 30 + [1] * 50
    counts, changes = simulate(trace)
    assert counts[:10] == [1] * 10  # light load: stays at the minimum
    # Step up: TTFT 3 s at 1 replica, 1.5 s at 2, 1.0 s (on target) at 3 -> settles at 3.
    assert max(counts[10:40]) == 3 and counts[39] == 3
    assert counts[10:40].count(3) >= 15  # and stays there while the load lasts
    # Step down: idle (TTFT far under target, no queue) -> back to the minimum.
    assert counts[-1] == 1
    ups = [t for t in changes if t < 40]
    downs = [t for t in changes if t >= 40]
    assert len(ups) == 2 and len(downs) == 2  # no oscillation on the way
    # Hysteresis: consecutive decisions are separated by the cooldown plus the streak needed.
    assert all(b - a >= CFG.cooldown_ticks + CFG.up_ticks for a, b in zip(ups, ups[1:]))
    assert all(b - a >= CFG.cooldown_ticks + CFG.down_ticks for a, b in zip(downs, downs[1:]))
    assert ups[0] - 10 == CFG.up_ticks - 1  # reacts after up_ticks pressured ticks, not before


def test_alternating_signals_never_scale():
    def model(load, n):
        return RoleSignal(replicas=n, ttft_p90_s=3.0 if load else 0.01)

    counts, changes = simulate([1, 0] * 40, model=model, start=2)
    assert changes == [] and set(counts) == {2}


def test_bounds_hold_under_sustained_pressure_and_idleness():
    counts, _ = simulate([100] * 60)
    assert max(counts) == 4 and counts[-1] == 4
    counts, _ = simulate([0] * 60, start=4)
    assert min(counts) == 1 and counts[-1] == 1


def test_queue_length_alone_is_prefill_pressure():
    state = PolicyState()
    for _ in range(CFG.up_ticks):
        state, out = decide(CFG, state, {"prefill": RoleSignal(replicas=1, waiting=20, ttft_p90_s=None)})
    assert out == {"prefill": 2}


def test_decode_scales_on_itl_and_kv_usage_and_down_when_calm():
    state, out = PolicyState(), {}
    for _ in range(CFG.up_ticks):
        state, out = decide(CFG, state, {"decode": RoleSignal(replicas=1, kv_usage=0.95, itl_p90_s=0.02)})
    assert out == {"decode": 2}
    state = PolicyState()
    for _ in range(CFG.up_ticks):
        state, out = decide(CFG, state, {"decode": RoleSignal(replicas=1, kv_usage=0.1, itl_p90_s=0.5)})
    assert out == {"decode": 2}
    state = PolicyState()
    for _ in range(CFG.down_ticks):
        state, out = decide(CFG, state, {"decode": RoleSignal(replicas=3, kv_usage=0.1, itl_p90_s=0.01)})
    assert out == {"decode": 2}
    # High KV usage is not idle even with a fast ITL: no scale-down.
    state = PolicyState()
    for _ in range(3 * CFG.down_ticks):
        state, out = decide(CFG, state, {"decode": RoleSignal(replicas=3, kv_usage=0.6, itl_p90_s=0.01)})
        assert out == {}


def test_roles_are_decided_independently():
    state = PolicyState()
    for _ in range(CFG.up_ticks):
        state, out = decide(CFG, state, {"prefill": RoleSignal(replicas=1, ttft_p90_s=5.0),
                                         "decode": RoleSignal(replicas=2, itl_p90_s=0.07, kv_usage=0.5)})
    assert out == {"prefill": 2}


@pytest.mark.parametrize("kw,needle", [
    ({"ttft_p90_target_s": 0}, "ttft_p90_target_s"),
    ({"look_back_period_s": 0}, "look_back_period_s"),
    ({"up_ticks": 0}, "up_ticks"),
    ({"cooldown_ticks": -1}, "cooldown_ticks"),
    ({"kv_usage_low": 0.9, "kv_usage_high": 0.5}, "kv_usage_low"),
    ({"min_replicas": {"prefill": 3}, "max_replicas": {"prefill": 2}}, "prefill"),
])
def test_bad_config_names_the_field(kw, needle):
    with pytest.raises(ValueError, match=needle):
        AutoscaleConfig(**kw)
