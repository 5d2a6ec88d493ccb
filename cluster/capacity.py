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


def describe(needed: Mapping[str, float], free: Mapping[str, float]) -> str:
    def fmt(d):
        return ", ".join(f"{res} {d.get(res, 0.0):g}" for res in sorted(needed)) or "nothing"

    return f"needs {fmt(needed)}; free {fmt(free)}"


def free_resources() -> dict[str, float]:
    import ray

    free = ray.available_resources()
    return {"CPU": float(free.get("CPU", 0.0)), "GPU": float(free.get("GPU", 0.0))}
