"""AppConfig rules about where a colocated engine core runs: in a child process of its replica
(`engine_core_process`), and that replica being the ingress itself (`direct_streaming`,
cluster.direct). Each refusal names its field, before Ray starts. (`cfg` is a cluster.app.AppConfig, which
calls these from its own checks.)"""

from __future__ import annotations

from engine.errors import ParameterError


def direct_by_default(cfg) -> bool:
    """Direct streaming unless something needs an engine deployment behind the ingress: P/D,
    HTTP processes scaled apart from the engines, pdserve's router (prefix affinity), or ranks
    and cores that are Ray actors of an engine replica."""
    args = cfg.engine_args
    return (cfg.mode == "colocated" and cfg.api_server_count == 1 and not cfg.prefix_affinity
            and args.tensor_parallel_size == 1 and args.data_parallel_size == 1
            and args.data_parallel_backend != "ray" and args.distributed_executor_backend != "ray")


def check_direct(cfg) -> None:
    def refuse(why: str) -> None:
        raise ParameterError("direct_streaming", f"direct_streaming {why}")

    if cfg.mode != "colocated":
        refuse(f"is for --mode colocated (got mode={cfg.mode!r}): a P/D request spans two replicas")
    if cfg.api_server_count != 1:
        refuse(f"makes every colocated replica its own HTTP server: scale with colocated_replicas, "
               f"not api_server_count (got {cfg.api_server_count})")
    if cfg.prefix_affinity:
        refuse("leaves spreading requests over the replicas to the HTTP proxy: prefix_affinity "
               "needs pdserve's router between the ingress and the engines")
    args = cfg.engine_args
    if args.tensor_parallel_size > 1 or args.data_parallel_size > 1:
        refuse("runs one engine core per replica in a child process; got "
               f"tensor_parallel_size={args.tensor_parallel_size}, data_parallel_size={args.data_parallel_size}")
    cfg.role_engine_args("colocated").create_engine_config()  # with its core process


def check_core_process(cfg) -> None:
    if cfg.mode == "pd":
        raise ParameterError("engine_core_process", "engine_core_process is for --mode colocated: a P/D "
                             "replica's engine core moves KV through the cluster's store from the replica's "
                             "own process")
    if cfg.engine_args.tensor_parallel_size > 1:
        # The cluster places a replica's ranks as Ray actors (its GPUs reserved with them),
        # which a core in a plain child process cannot own.
        raise ParameterError("engine_core_process", "engine_core_process serves one rank per replica in the "
                             f"cluster; got tensor_parallel_size={cfg.engine_args.tensor_parallel_size}")
    for role in cfg.targets():  # the engine config each replica will build, checked now
        cfg.role_engine_args(role).create_engine_config()
