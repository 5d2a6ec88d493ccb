"""Whether a scale target fits the cluster, and what a pending one waits for.

Figures are Ray's cluster-wide free resources against what the added replicas reserve
(`replica_num_cpus` / `replica_num_gpus` each). A sum over nodes is optimistic — a replica
must fit on one node — so a target that passes here can still wait; /status then shows
`pending` with the shortfall Serve's replicas are waiting on.
"""

from __future__ import annotations

from collections.abc import Mapping

_EPS = 1e-9


def needed_for(added: Mapping[str, int], per_replica: Mapping[str, float]) -> dict[str, float]:
    """Resources the `added` replicas (per role) reserve together."""
    n = sum(max(0, k) for k in added.values())
    return {res: n * amount for res, amount in per_replica.items() if amount > 0}


def shortfall(needed: Mapping[str, float], free: Mapping[str, float]) -> dict[str, float]:
    """What is missing, per resource (empty when it fits)."""
    return {res: round(amount - free.get(res, 0.0), 3) for res, amount in needed.items()
            if amount > free.get(res, 0.0) + _EPS}


def _amounts(amounts: Mapping[str, float], resources) -> str:
    """"CPU 2, GPU 1": `amounts` of `resources`, in name order."""
    return ", ".join(f"{res} {amounts.get(res, 0.0):g}" for res in sorted(resources)) or "nothing"


def describe(needed: Mapping[str, float], free: Mapping[str, float]) -> str:
    return f"needs {_amounts(needed, needed)}; free {_amounts(free, needed)}"


def initial_resources(replicas: Mapping[str, int], per_replica: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """What the engine replicas reserve together at their start-up counts: `replicas` of each
    role, each reserving `per_replica[role]` (the Coordinator, KV store and an ingress without
    an engine reserve none)."""
    needed = {"CPU": 0.0, "GPU": 0.0}
    for role, count in replicas.items():
        for name, amount in per_replica[role].items():
            needed[name] += count * amount
    return {name: amount for name, amount in needed.items() if amount > 0}


def startup_refusal(needed: Mapping[str, float], total: Mapping[str, float], mode: str) -> str | None:
    """Why an app whose engine replicas reserve `needed` cannot start on a cluster of `total`
    resources (None when it fits): Serve would otherwise wait for ever on the replicas that
    find no room. Sharing one GPU between P/D's two roles is the commonest case, so the
    message says how."""
    short = shortfall(needed, total)
    if not short:
        return None
    hint = ""
    if "GPU" in short and mode == "pd":
        hint = ("; to share GPUs between the prefill and decode replicas give each a fraction, e.g. "
                "--replica-gpus 0.5 --gpu-memory-utilization 0.45 on one GPU")
    elif "GPU" in short:
        hint = "; lower the replica counts or --replica-gpus"
    elif "CPU" in short:
        hint = "; lower the replica counts or --replica-cpus"
    return (f"the engine replicas need {_amounts(needed, needed)} in all; this Ray has "
            f"{_amounts(total, needed)}{hint}")


def _cpu_gpu(resources: Mapping[str, float]) -> dict[str, float]:
    return {"CPU": float(resources.get("CPU", 0.0)), "GPU": float(resources.get("GPU", 0.0))}


def total_resources() -> dict[str, float]:
    import ray

    return _cpu_gpu(ray.cluster_resources())


def free_resources() -> dict[str, float]:
    import ray

    return _cpu_gpu(ray.available_resources())


def auto_replica_cpus(node_cpus: list[float], engine_replicas: int) -> float:
    """CPUs (hence torch threads: Ray sets OMP_NUM_THREADS to the reservation) of each CPU
    engine replica when none were given: the cluster's CPUs shared evenly among the app's
    engine replicas, no more than the largest node has (a replica lives on one node), at least
    one. A CPU engine is compute-bound and its threads are its speed, so a lone replica takes
    its node (vLLM's CPU backend binds every core of a single engine likewise); two processes
    given the same cores measured slower than each on its own half (docs/serving.md#threads-of-cpu-engine-replicas, "Threads of CPU
    engine replicas")."""
    if engine_replicas < 1:
        raise ValueError(f"engine_replicas must be >= 1, got {engine_replicas}")
    cpus = [c for c in node_cpus if c > 0]
    if not cpus:
        return 1.0
    return float(max(1, int(min(max(cpus), sum(cpus) / engine_replicas))))


def node_cpus() -> list[float]:
    """CPUs of each live node of the connected Ray cluster."""
    import ray

    return [float(n["Resources"].get("CPU", 0.0)) for n in ray.nodes() if n.get("Alive")]
