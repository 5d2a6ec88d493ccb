"""What the Coordinator answers, typed: a scale's result and the app's status. The HTTP side
(cluster.http.control_answers) turns them into responses, in one place."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from cluster.report import ReplicaReport


@dataclass(frozen=True)
class ScaleResult:
    """What `POST /scale` did: accepted (202, the new `target`), or refused with `status` (400:
    bad input, naming `param`; 409: another change is in progress, the autoscaler owns the
    counts, or the target does not fit; 503: Serve refused the change), `message` and, for a
    target that does not fit, `details` (the resources `needed` and `free`)."""

    status: int
    target: dict[str, int] | None = None
    message: str | None = None
    error_type: str | None = None  # OpenAI's error `type`
    param: str | None = None
    details: dict = field(default_factory=dict)

    @classmethod
    def accept(cls, target: dict[str, int]) -> ScaleResult:
        return cls(202, target=dict(target))

    @classmethod
    def refuse(cls, status: int, message: str, error_type: str, param: str | None = None, **details) -> ScaleResult:
        return cls(status, message=message, error_type=error_type, param=param, details=details)

    @property
    def accepted(self) -> bool:
        return self.status == 202


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica's line in `GET /status`."""

    replica: str
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    kv_usage: float
    prefix_cache_hit_rate: float
    ttft_p90_s: float | None
    itl_p90_s: float | None
    kv_handoffs: int
    time: float
    cpu_kernels: str | None  # the CPU kernels' ISA level (engine.load.EngineLoad); None on a GPU
    # Prefix blocks held per medium (KV events on: --router-mode kv); {} otherwise.
    kv_cached_blocks: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, report: ReplicaReport) -> ReplicaStatus:
        e = report.engine
        return cls(report.replica, e.running, e.waiting, e.free_blocks, e.total_blocks, e.kv_usage,
                   e.prefix_cache_hit_rate, report.ttft_p90_s, report.itl_p90_s, report.kv_handoffs, report.time,
                   e.cpu_kernels, dict(report.kv_cached_blocks))


@dataclass(frozen=True)
class Status:
    """`GET /status`: the live replicas of each role, the KV store's figures, and the scaling
    state (the target, whether it is being reached, what it waits for)."""

    mode: str
    replicas: dict[str, list[ReplicaStatus]]  # role -> its live replicas
    store: dict
    scaling: bool
    target: dict[str, int]
    autoscaling: bool
    stuck: str | None
    pending: dict | None

    def as_json(self) -> dict:
        """The response body: each role's replicas under the role's name, beside the rest."""
        body = {role: [dataclasses.asdict(r) for r in replicas] for role, replicas in self.replicas.items()}
        body.update(mode=self.mode, store=self.store, scaling=self.scaling, target=dict(self.target),
                    autoscaling=self.autoscaling, stuck=self.stuck, pending=self.pending)
        return body
