"""The `pdserve` Serve application: Ingress, Prefill, Decode (or Colocated) and Coordinator.

`build` is the import path Serve config files use (`import_path: cluster.app:build`, with
`args:` holding AppConfig fields); `build_app(AppConfig)` is the same from Python. Deploy it
with `external_scaler_enabled` (`serve.run(..., external_scaler_enabled=True)`, or
`external_scaler_enabled: true` in the config): the Coordinator changes replica counts through
Serve's external-scaling API.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.autoscale import build_config
from cluster.coordinator import Coordinator
from cluster.ingress import Ingress
from cluster.replica import EngineServer
from cluster.router import LeastLoadRouter
from engine.args import EngineArgs

MODES = ("pd", "colocated")
POLICIES = ("fail", "recompute")
_ENGINE_KEYS = ("dtype", "num_kv_blocks", "kv_cache_memory_gb", "max_model_len", "max_num_seqs",
                "max_num_batched_tokens", "block_size", "enable_prefix_caching", "gpu_memory_utilization",
                "enforce_eager", "seed")


@dataclass(frozen=True)
class AppConfig:
    model: str
    mode: str = "pd"
    prefill_replicas: int = 1
    decode_replicas: int = 1
    colocated_replicas: int = 1
    served_model_name: str | None = None
    app_name: str = "pdserve"
    # engine
    dtype: str = "auto"
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    seed: int = 0
    # serving
    load_failure_policy: str = "fail"
    max_pending_requests: int = 1024  # per ingress replica; beyond it: 503 + Retry-After
    max_ongoing_requests: int = 1024  # per engine replica (Serve's own cap)
    graceful_shutdown_timeout_s: float = 60.0
    prefix_affinity: bool = False
    routing_stats_period_s: float = 0.5
    replica_num_cpus: float = 1.0
    replica_num_gpus: float | None = None  # None: 1 when this machine has a CUDA GPU, else 0
    max_replicas: int = 8  # per role: the ceiling of POST /scale (and of autoscaling by default)
    autoscale: dict | None = None  # cluster.autoscale.AutoscaleConfig fields; {"enabled": True} turns it on
    extra_engine_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.load_failure_policy not in POLICIES:
            raise ValueError(f"load_failure_policy must be one of {POLICIES}, got {self.load_failure_policy!r}")
        for name in ("prefill_replicas", "decode_replicas", "colocated_replicas", "max_pending_requests",
                     "max_ongoing_requests", "max_replicas"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not os.path.isdir(self.model):
            raise ValueError(f"model must be a model directory visible to every node; {self.model!r} does not exist")
        if self.replica_num_cpus < 0:
            raise ValueError(f"replica_num_cpus must be >= 0, got {self.replica_num_cpus}")
        if self.replica_num_gpus is not None and self.replica_num_gpus < 0:
            raise ValueError(f"replica_num_gpus must be >= 0, got {self.replica_num_gpus}")
        for role, n in self.targets().items():
            if n > self.max_replicas:
                raise ValueError(f"{role}_replicas must be <= max_replicas ({self.max_replicas})")
        build_config(self.autoscale, self.max_replica_map())  # validates, as the Coordinator will build it

    def targets(self) -> dict[str, int]:
        if self.mode == "pd":
            return {"prefill": self.prefill_replicas, "decode": self.decode_replicas}
        return {"colocated": self.colocated_replicas}

    def max_replica_map(self) -> dict[str, int]:
        return {r: self.max_replicas for r in self.targets()}

    @property
    def model_name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model))

    def engine_kwargs(self) -> dict:
        return {**{k: getattr(self, k) for k in _ENGINE_KEYS}, **self.extra_engine_kwargs}

    def num_gpus(self) -> float:
        if self.replica_num_gpus is not None:
            return self.replica_num_gpus
        import torch

        return 1.0 if torch.cuda.is_available() else 0.0


def build_app(cfg: AppConfig):
    engine_kwargs = cfg.engine_kwargs()
    router = RequestRouterConfig(
        request_router_class=LeastLoadRouter,
        request_router_kwargs={"prefix_affinity": cfg.prefix_affinity},
        request_routing_stats_period_s=cfg.routing_stats_period_s,
        request_routing_stats_timeout_s=5.0,
    )
    engine_options = dict(
        max_ongoing_requests=cfg.max_ongoing_requests,
        graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
        health_check_period_s=5.0,
        request_router_config=router,
        ray_actor_options={"num_cpus": cfg.replica_num_cpus, "num_gpus": cfg.num_gpus()},
    )

    def engine(name: str, role: str, replicas: int):
        return serve.deployment(EngineServer, name=name, num_replicas=replicas, **engine_options).bind(
            EngineArgs.from_kwargs(cfg.model, **engine_kwargs), role, cfg.app_name, cfg.load_failure_policy)

    coordinator = serve.deployment(Coordinator, name="Coordinator", num_replicas=1,
                                   ray_actor_options={"num_cpus": 0}).bind(
        cfg.mode, cfg.app_name, cfg.targets(), cfg.max_replica_map(), dict(cfg.autoscale or {}))
    if cfg.mode == "pd":
        first, second = engine("Prefill", "prefill", cfg.prefill_replicas), engine("Decode", "decode",
                                                                                   cfg.decode_replicas)
    else:
        first, second = engine("Colocated", "colocated", cfg.colocated_replicas), None
    settings = {"mode": cfg.mode, "model": cfg.model, "served_model_name": cfg.model_name,
                "max_pending_requests": cfg.max_pending_requests, "load_failure_policy": cfg.load_failure_policy,
                "engine_kwargs": engine_kwargs, "app_name": cfg.app_name}
    return serve.deployment(Ingress, name="Ingress", num_replicas=1, max_ongoing_requests=cfg.max_pending_requests * 2,
                            graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
                            ray_actor_options={"num_cpus": 0}).bind(first, second, coordinator, settings)


def build(args: dict):
    """Serve config entry point: `args` are AppConfig fields; `model` defaults to the tiny
    default model (made on first use)."""
    args = dict(args or {})
    if not args.get("model"):
        from cluster.cli import ensure_default_model

        args["model"] = ensure_default_model("tiny")
    known = {f.name for f in dataclasses.fields(AppConfig)}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown app arguments {unknown}; allowed: {sorted(known)}")
    return build_app(AppConfig(**args))
