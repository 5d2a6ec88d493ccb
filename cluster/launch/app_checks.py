"""AppConfig rules about where an engine core runs: in a child process of its replica
(`engine_core_process`), and that replica being the ingress itself (`direct_streaming`,
cluster.replica.direct: the colocated engines, or in P/D the decode engines). Each refusal names its
field, before Ray starts. (`cfg` is a cluster.launch.app.AppConfig, which calls these from its own
checks.)"""

from __future__ import annotations

from engine.errors import ParameterError


def direct_role(mode: str) -> str:
    """The role whose engines the ingress replicas run with direct streaming: the one that
    streams tokens (decode in P/D)."""
    return "decode" if mode == "pd" else "colocated"


def direct_by_default(cfg) -> bool:
    """Direct streaming unless something needs an engine deployment behind the ingress: HTTP
    processes scaled apart from the engines, pdserve's router in front of colocated engines
    (prefix affinity; in P/D it routes the prefills, which stay a deployment), or ranks and
    cores that are Ray actors of an engine replica (of the role the ingress would run)."""
    role = cfg.direct_role
    args = cfg.engine_args
    return (cfg.api_server_count == 1 and not _affinity_needs_router(cfg)
            and cfg.tensor_parallel_size(role) == 1 and cfg.data_parallel_size(role) == 1
            and args.data_parallel_backend != "ray" and args.distributed_executor_backend != "ray")


def _affinity_needs_router(cfg) -> bool:
    # Prompts sharing a prefix go to one engine replica by pdserve's router. In P/D that is
    # the prefill's (where the prefix is computed), which direct streaming leaves in place.
    return cfg.prefix_affinity and cfg.mode == "colocated"


def check_direct(cfg) -> None:
    def refuse(why: str) -> None:
        raise ParameterError("direct_streaming", f"direct_streaming {why}")

    role = cfg.direct_role
    if cfg.api_server_count != 1:
        refuse(f"makes every {role} replica its own HTTP server: scale with {role}_replicas, "
               f"not api_server_count (got {cfg.api_server_count})")
    if _affinity_needs_router(cfg):
        refuse("leaves spreading requests over the replicas to the HTTP proxy: prefix_affinity "
               "needs pdserve's router between the ingress and the colocated engines")
    tp, dp = cfg.tensor_parallel_size(role), cfg.data_parallel_size(role)
    if tp > 1 or dp > 1:
        refuse(f"runs one engine core per {role} replica in a child process; got "
               f"tensor_parallel_size={tp}, data_parallel_size={dp}")
    cfg.role_engine_args(role).create_engine_config()  # with its core process


def check_core_process(cfg) -> None:
    # A P/D core's connector relays its transfers through its replica (kvstore.transports.relay).
    tp = max(cfg.tensor_parallel_size(role) for role in cfg.targets())
    if tp > 1:
        # The cluster places a replica's ranks as Ray actors (its GPUs reserved with them),
        # which a core in a plain child process cannot own.
        raise ParameterError("engine_core_process", "engine_core_process serves one rank per replica in the "
                             f"cluster; got tensor_parallel_size={tp}")
    for role in cfg.targets():  # the engine config each replica will build, checked now
        cfg.role_engine_args(role).create_engine_config()
