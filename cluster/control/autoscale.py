"""SLO-driven autoscaling policy: a pure function of the observed signals and its own state.

Every tick the Coordinator summarises each role from the replicas' reports (`RoleSignal`) and
calls `decide`. Prefill scales on TTFT pressure (p90 above target) and queue length; decode on
ITL pressure and KV-cache usage; colocated on any of them. Hysteresis keeps it from flapping:
scaling up needs `up_ticks` consecutive pressured ticks, scaling down `down_ticks` consecutive
idle ticks (idle = latency well under target *and* no queue / low KV use), one step at a time,
then `cooldown_ticks` without decisions while the new replica warms up and the latency windows
(which still hold samples from before the change) refresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class AutoscaleConfig:
    enabled: bool = False
    interval_s: float = 2.0
    ttft_p90_target_s: float = 1.0
    itl_p90_target_s: float = 0.1
    # The replicas' TTFT/ITL p90 cover this many seconds of samples (Ray Serve's autoscaling
    # `look_back_period_s`): shorter follows load faster, longer is steadier. After traffic
    # stops a role counts as idle once its window empties.
    look_back_period_s: float = 10.0
    min_replicas: dict = field(default_factory=lambda: {"prefill": 1, "decode": 1, "colocated": 1})
    max_replicas: dict = field(default_factory=lambda: {"prefill": 4, "decode": 4, "colocated": 4})
    queue_per_replica_high: float = 8.0  # waiting requests per replica that count as pressure
    kv_usage_high: float = 0.85
    kv_usage_low: float = 0.4
    idle_fraction: float = 0.5  # latency below target * this counts as idle
    up_ticks: int = 2
    down_ticks: int = 5
    cooldown_ticks: int = 5

    def __post_init__(self) -> None:
        for name in ("interval_s", "ttft_p90_target_s", "itl_p90_target_s", "look_back_period_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"autoscale {name} must be > 0, got {getattr(self, name)}")
        for name in ("up_ticks", "down_ticks"):
            if getattr(self, name) < 1:
                raise ValueError(f"autoscale {name} must be >= 1, got {getattr(self, name)}")
        if self.cooldown_ticks < 0:
            raise ValueError(f"autoscale cooldown_ticks must be >= 0, got {self.cooldown_ticks}")
        if not 0 <= self.kv_usage_low < self.kv_usage_high <= 1:
            raise ValueError("autoscale needs 0 <= kv_usage_low < kv_usage_high <= 1")
        for role in ROLES:
            lo, hi = self.min_replicas.get(role, 1), self.max_replicas.get(role, 1)
            if not 1 <= lo <= hi:
                raise ValueError(f"autoscale replicas for {role} need 1 <= min ({lo}) <= max ({hi})")


@dataclass(frozen=True)
class RoleSignal:
    replicas: int  # the current target (what Serve is converging to)
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    ttft_p90_s: float | None = None
    itl_p90_s: float | None = None


@dataclass(frozen=True)
class PolicyState:
    streak: dict = field(default_factory=dict)  # role -> +n pressured ticks / -n idle ticks
    cooldown: dict = field(default_factory=dict)  # role -> ticks left without decisions


def _pressure(role: str, s: RoleSignal, cfg: AutoscaleConfig) -> bool:
    queue = s.waiting / max(s.replicas, 1) > cfg.queue_per_replica_high
    ttft = s.ttft_p90_s is not None and s.ttft_p90_s > cfg.ttft_p90_target_s
    itl = s.itl_p90_s is not None and s.itl_p90_s > cfg.itl_p90_target_s
    kv = s.kv_usage > cfg.kv_usage_high
    if role == "prefill":
        return ttft or queue
    if role == "decode":
        return itl or kv
    return ttft or itl or queue or kv


def _idle(role: str, s: RoleSignal, cfg: AutoscaleConfig) -> bool:
    def calm(value, target):
        return value is None or value < target * cfg.idle_fraction

    ttft = calm(s.ttft_p90_s, cfg.ttft_p90_target_s)
    itl = calm(s.itl_p90_s, cfg.itl_p90_target_s)
    if role == "prefill":
        return ttft and s.waiting == 0
    if role == "decode":
        return itl and s.kv_usage < cfg.kv_usage_low
    return ttft and itl and s.waiting == 0 and s.kv_usage < cfg.kv_usage_low


def decide(cfg: AutoscaleConfig, state: PolicyState, signals: dict[str, RoleSignal]
           ) -> tuple[PolicyState, dict[str, int]]:
    """(new state, {role: new replica count}) — only roles whose count changes appear."""
    streak, cooldown, targets = dict(state.streak), dict(state.cooldown), {}
    for role, s in signals.items():
        if cooldown.get(role, 0) > 0:
            cooldown[role] -= 1
            streak[role] = 0
            continue
        prev = streak.get(role, 0)
        if _pressure(role, s, cfg):
            streak[role] = max(prev, 0) + 1
        elif _idle(role, s, cfg):
            streak[role] = min(prev, 0) - 1
        else:
            streak[role] = 0
        lo, hi = cfg.min_replicas.get(role, 1), cfg.max_replicas.get(role, 1)
        n = s.replicas
        if streak[role] >= cfg.up_ticks and n < hi:
            targets[role] = n + 1
        elif streak[role] <= -cfg.down_ticks and n > lo:
            targets[role] = n - 1
        if role in targets:
            streak[role] = 0
            cooldown[role] = cfg.cooldown_ticks
    return replace(state, streak=streak, cooldown=cooldown), targets


def build_config(overrides: dict | None, max_replicas: dict[str, int]) -> AutoscaleConfig:
    """AutoscaleConfig from user fields; the ceiling defaults, role by role, to the manual one."""
    kw = dict(overrides or {})
    kw["max_replicas"] = {**max_replicas, **(kw.get("max_replicas") or {})}
    try:
        return AutoscaleConfig(**kw)
    except TypeError as e:  # an unknown field
        raise ValueError(f"autoscale: {e}") from e
