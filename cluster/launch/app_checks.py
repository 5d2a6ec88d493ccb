"""AppConfig rules about where an engine core runs: in a child process of its replica
(`engine_core_process`), and that replica being the ingress itself (`direct_streaming`,
cluster.replica.server: the colocated engines, or in P/D the decode engines), and the bounds of
its numbers and choices. Each refusal names its field, before Ray starts. AppConfig (cluster.launch.app) calls these with its resolved values."""

from __future__ import annotations

from cluster.http.migration import check_migration_limit
from cluster.roles import Role
from engine.args import EngineArgs
from engine.errors import ParameterError, check_choice, check_int


def direct_role(mode: str) -> Role:
    """The role whose engines the ingress replicas run with direct streaming: the one that
    streams tokens (decode in P/D)."""
    return Role.DECODE if mode == "pd" else Role.COLOCATED


def direct_by_default(mode: str, api_server_count: int, prefix_affinity: bool, role_args: EngineArgs) -> bool:
    """Direct streaming unless something needs an engine deployment behind the ingress (see
    `_direct_refusal`), or the role's ranks or cores would be Ray actors of an engine replica.
    `role_args`: the engine of the role the ingress would run (its own tensor and data
    parallel sizes)."""
    return (_direct_refusal(mode, api_server_count, prefix_affinity, role_args) is None
            and role_args.data_parallel_backend != "ray" and role_args.distributed_executor_backend != "ray")


def check_direct(mode: str, api_server_count: int, prefix_affinity: bool, role_args: EngineArgs) -> None:
    """Refuse direct streaming where it cannot run; `role_args` as for direct_by_default, with
    its core process."""
    why = _direct_refusal(mode, api_server_count, prefix_affinity, role_args)
    if why is not None:
        raise ParameterError("direct_streaming", f"direct_streaming {why}")
    role_args.create_engine_config()  # with its core process


def _direct_refusal(mode: str, api_server_count: int, prefix_affinity: bool, role_args: EngineArgs) -> str | None:
    """Why the ingress cannot run the engines of its role itself, or None: HTTP processes
    scaled apart from the engines, pdserve's router in front of colocated engines (prefix
    affinity; in P/D it routes the prefills, which stay a deployment), or more than one
    core or rank per engine (direct streaming runs one core per replica, in a child process)."""
    role = direct_role(mode)
    if api_server_count != 1:
        return (f"makes every {role} replica its own HTTP server: scale with {role}_replicas, "
                f"not api_server_count (got {api_server_count})")
    if prefix_affinity and mode == "colocated":
        return ("leaves spreading requests over the replicas to the HTTP proxy: a router_mode other than "
                "least-loaded (or prefix_affinity) needs pdserve's router between the ingress and the "
                "colocated engines")
    if role_args.kv_shared_tier_size is not None:
        # kvstore.shared_tier: its connector calls the KV store from the engine's own process.
        return ("runs the engine in a core process of the ingress, and kv_shared_tier_size needs the engine "
                "in an engine replica's process: leave direct_streaming unset or false")
    tp, dp = role_args.tensor_parallel_size, role_args.data_parallel_size
    if tp > 1 or dp > 1:
        return (f"runs one engine core per {role} replica in a child process; got "
                f"tensor_parallel_size={tp}, data_parallel_size={dp}")
    return None


def check_tool_flags(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    """vLLM's rule: "auto" tool choice needs a parser, and a parser must be a known one."""
    from cluster.http.tool_parsers import get_tool_parser

    if tool_call_parser is not None:
        try:
            get_tool_parser(tool_call_parser)
        except ValueError as e:
            raise ParameterError("tool_call_parser", str(e)) from None
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ParameterError("enable_auto_tool_choice", "enable_auto_tool_choice needs tool_call_parser "
                             "(--tool-call-parser NAME)")


def check_core_process(roles_args: list[EngineArgs]) -> None:
    """Refuse engine_core_process where a replica's engine cannot run apart; `roles_args`: the
    engine of each role's replicas."""
    # A P/D core's connector relays its transfers through its replica (kvstore.transports.relay).
    tp = max(args.tensor_parallel_size for args in roles_args)
    if tp > 1:
        # The cluster places a replica's ranks as Ray actors (its GPUs reserved with them),
        # which a core in a plain child process cannot own.
        raise ParameterError("engine_core_process", "engine_core_process serves one rank per replica in the "
                             f"cluster; got tensor_parallel_size={tp}")
    for args in roles_args:  # the engine config each replica will build, checked now
        args.create_engine_config()


def check_bounds(cfg) -> None:
    """AppConfig's numbers and choices within their ranges (each error names its field)."""
    from cluster.http.structured_config import StructuredOutputsConfig
    from cluster.replica.router import ROUTER_MODES  # here: Serve's router classes load with it

    StructuredOutputsConfig.of(cfg.structured_outputs_config)  # its fields, checked

    if not 0 < cfg.scale_timeout_s <= 3600:
        raise ParameterError("scale_timeout_s", f"scale_timeout_s must be in (0, 3600], got {cfg.scale_timeout_s}")
    if not 0 <= cfg.stream_interval_ms <= 1000:
        raise ParameterError("stream_interval_ms",
                             f"stream_interval_ms must be in [0, 1000], got {cfg.stream_interval_ms}")
    if not 0 < cfg.health_check_period_s <= 600:
        raise ParameterError("health_check_period_s",
                             f"health_check_period_s must be in (0, 600], got {cfg.health_check_period_s}")
    if not 0 < cfg.graceful_shutdown_wait_loop_s <= 60:
        raise ParameterError("graceful_shutdown_wait_loop_s", "graceful_shutdown_wait_loop_s must be in "
                             f"(0, 60], got {cfg.graceful_shutdown_wait_loop_s}")
    if cfg.replica_num_cpus is not None and cfg.replica_num_cpus < 0:
        raise ParameterError("replica_num_cpus", f"replica_num_cpus must be >= 0, got {cfg.replica_num_cpus}")
    if cfg.replica_num_threads is not None:
        check_int("replica_num_threads", cfg.replica_num_threads)
    if cfg.replica_num_gpus is not None and cfg.replica_num_gpus < 0:
        raise ParameterError("replica_num_gpus", f"replica_num_gpus must be >= 0, got {cfg.replica_num_gpus}")
    check_migration_limit(cfg.migration_limit)
    if cfg.router_mode is not None:
        check_choice("router_mode", cfg.router_mode, ROUTER_MODES)
        if cfg.prefix_affinity and cfg.router_mode != "prefix-affinity":
            raise ParameterError("router_mode", f"prefix_affinity is router_mode 'prefix-affinity'; got "
                                 f"router_mode {cfg.router_mode!r} beside it")
    if cfg.reasoning_parser is not None:
        from cluster.http.reasoning import REASONING_PARSERS

        check_choice("reasoning_parser", cfg.reasoning_parser, tuple(sorted(REASONING_PARSERS)))
    if not cfg.kv_overlap_score_weight >= 0:
        raise ParameterError("kv_overlap_score_weight", f"kv_overlap_score_weight must be >= 0, "
                             f"got {cfg.kv_overlap_score_weight}")
