"""The `pdserve` Serve application: Ingress, Prefill, Decode (or Colocated) and Coordinator.

`build` is the import path Serve config files use (`import_path: cluster.launch.app:build`, with
`args:` holding AppConfig fields and EngineArgs fields side by side, flat);
`build_app(AppConfig)` is the same from Python. Deploy it with `external_scaler_enabled`
(`serve.run(..., external_scaler_enabled=True)`, or `external_scaler_enabled: true` in the
config): the Coordinator changes replica counts through Serve's external-scaling API.
"""

from __future__ import annotations

import time

from ray import serve
from ray.serve.config import RequestRouterConfig

from actors.ray_executor import PLACEMENT_STRATEGY
from cluster.control.autoscale import build_config
from cluster.control.capacity import node_cpus
from cluster.control.coordinator import DEPLOYMENTS, Coordinator
from cluster.http.auth import digest, keys_from
from cluster.http.ingress import Ingress
from cluster.http.ingress_router import IngressRouter
from cluster.http.settings import DirectSettings, IngressSettings
from cluster.http.structured_config import StructuredOutputsConfig
from cluster.launch.app_config import AppConfig
from cluster.launch.open_doors import check_open_admin, serve_http_host
from cluster.pd.placement import LocalPrefillRule
from cluster.replica.router import LeastLoadRouter
from cluster.replica.server import EngineServer
from cluster.roles import Role
from engine.models.default_model import default_model

# Serve writes one access line per call into a replica's log, twice (its file and stderr,
# flushed each time). For the calls between pdserve's own deployments (a submit and an abort
# per request, prefills, heartbeats) that is noise; without it the engine replica spent ~10%
# less CPU per short request (docs/benchmarks.md#access-log). Failures are still logged.
_NO_ACCESS_LOG = {"enable_access_log": False}


def build_app(cfg: AppConfig):
    # Ray is connected by now, and Serve started: its HTTP host says who can reach the app.
    check_open_admin(bool(keys_from(cfg.api_keys)), cfg.allow_unauthenticated_admin, serve_http_host())
    cfg = cfg.sized_for(node_cpus())
    router = RequestRouterConfig(
        request_router_class=LeastLoadRouter,
        request_router_kwargs=cfg.router_kwargs(),
        request_routing_stats_period_s=cfg.routing_stats_period_s,
        request_routing_stats_timeout_s=5.0,
    )
    engine_options = dict(
        logging_config=_NO_ACCESS_LOG,
        max_ongoing_requests=cfg.max_ongoing_requests,
        graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=cfg.graceful_shutdown_wait_loop_s,
        health_check_period_s=cfg.health_check_period_s,
        request_router_config=router,
    )

    # The window of the replicas' latency figures is the autoscaler's look-back period.
    latency_window_s = build_config(cfg.autoscale, cfg.max_replica_map()).look_back_period_s

    def server_kwargs(role: Role) -> dict:
        return dict(engine_args=cfg.role_engine_args(role), role=role, app_name=cfg.app_name,
                    load_failure_policy=cfg.load_failure_policy, stream_interval_ms=cfg.stream_interval_ms,
                    latency_window_s=latency_window_s)

    def engine(name: str, role: Role, replicas: int):
        options = dict(engine_options, ray_actor_options=cfg.engine_actor_options(role))
        bundles = cfg.placement_bundles(role)
        if bundles is not None:
            # Serve reserves the replica and its rank actors together, and replaces them together.
            options.update(placement_group_bundles=bundles, placement_group_strategy=PLACEMENT_STRATEGY)
        return serve.deployment(EngineServer, name=name, num_replicas=replicas, **options).bind(**server_kwargs(role))

    # With direct streaming the colocated (or decode) engines are the ingress replicas themselves.
    deployments = dict(DEPLOYMENTS, **{cfg.direct_role: "Ingress"}) if cfg.direct else DEPLOYMENTS
    coordinator = serve.deployment(Coordinator, name="Coordinator", num_replicas=1, logging_config=_NO_ACCESS_LOG,
                                   graceful_shutdown_wait_loop_s=cfg.graceful_shutdown_wait_loop_s,
                                   ray_actor_options={"num_cpus": 0}).bind(
        cfg.mode, cfg.app_name, cfg.targets(), cfg.max_replica_map(), dict(cfg.autoscale or {}),
        scale_timeout_s=cfg.scale_timeout_s,
        replica_resources=cfg.replica_resources(),
        cluster_autoscaling=cfg.cluster_autoscaling, deployments=deployments)
    if cfg.mode == "pd":
        first = engine("Prefill", Role.PREFILL, cfg.prefill_replicas)
        second = None if cfg.direct else engine("Decode", Role.DECODE, cfg.decode_replicas)
    elif cfg.direct:
        first = second = None
    else:
        first, second = engine("Colocated", Role.COLOCATED, cfg.colocated_replicas), None
    direct = None
    ingress_options = dict(num_replicas=cfg.api_server_count, ray_actor_options={"num_cpus": 0})
    if cfg.direct:
        # Each ingress replica is an engine replica: it reserves what one needs, and Serve
        # replaces it when its engine dies (cluster.replica.server).
        role = cfg.direct_role
        direct = DirectSettings(server_kwargs(role), cfg.routing_stats_period_s)
        ingress_options = dict(num_replicas=cfg.targets()[role], ray_actor_options=cfg.engine_actor_options(role),
                               health_check_period_s=cfg.health_check_period_s,
                               request_router_config=RequestRouterConfig(request_router_class=IngressRouter))
    settings = IngressSettings(
        mode=cfg.mode, engine_args=cfg.engine_args, served_model_name=cfg.model_name, app_name=cfg.app_name,
        max_pending_requests=cfg.max_pending_requests, load_failure_policy=cfg.load_failure_policy,
        body_limits=cfg.body_limits(), request_limits=cfg.request_limits(), prefill_fallback=cfg.prefill_fallback(),
        migration_limit=cfg.migration_limit,
        created=int(time.time()), local_prefill=LocalPrefillRule(cfg.local_prefill_queue, cfg.max_local_prefill_length),
        api_key_digests=tuple(digest(k) for k in keys_from(cfg.api_keys)), metrics_without_key=cfg.metrics_without_key,
        enable_prompt_tokens_details=cfg.enable_prompt_tokens_details,
        direct=direct,
        enable_auto_tool_choice=cfg.enable_auto_tool_choice, tool_call_parser=cfg.tool_call_parser,
        reasoning_parser=cfg.reasoning_parser,
        structured_outputs_config=StructuredOutputsConfig.of(cfg.structured_outputs_config),
        lora_modules=cfg.lora_module_list(), lora_runtime_updates=cfg.enable_lora_runtime_updating)
    return serve.deployment(Ingress, name="Ingress", max_ongoing_requests=cfg.max_pending_requests * 2,
                            graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
                            graceful_shutdown_wait_loop_s=cfg.graceful_shutdown_wait_loop_s,
                            logging_config={"enable_access_log": not cfg.disable_access_log},
                            **ingress_options).bind(first, second, coordinator, settings)


def build(args: dict):
    """Serve config entry point: `args` are AppConfig and EngineArgs fields, flat; `model`
    defaults to the default model (SmolLM2-135M-Instruct, shipped as a package)."""
    args = dict(args or {})
    if not args.get("model"):
        args["model"] = default_model()
    return build_app(AppConfig.from_flat(args))
