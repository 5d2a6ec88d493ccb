"""Serve's request router for the ingress replicas under direct streaming, where each is an
engine replica and a request whose engine failed goes on on another one (Ingress.resume,
cluster.http.migration). Serve's default router (power of two choices: two random replicas,
the shorter queue wins) would often pick exactly the replica that failed, its queue being the
shortest once its requests failed. This one chooses as Serve's does (this node's replicas
first, then two at random, the shorter queue winning), except that a call naming the replica
to `avoid` never goes there while another is a candidate."""

from __future__ import annotations

import random

from ray.serve.request_router import FIFOMixin, LocalityMixin, RequestRouter

_PREFIX = "ingress-"


def ingress_id(unique_id: str) -> str:
    """The id an ingress replica goes by (metrics, subscriptions, migrations): from Serve's
    replica id."""
    return f"{_PREFIX}{unique_id}"


def pass_over(candidates: list, avoid: str | None) -> list:
    """`candidates` less the replica whose ingress id is `avoid`, unless it is the only one."""
    if not avoid:
        return candidates
    kept = [r for r in candidates if ingress_id(r.replica_id.unique_id) != avoid]
    return kept or candidates


class IngressRouter(FIFOMixin, LocalityMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas, pending_request=None):
        avoid = (pending_request.kwargs or {}).get("avoid") if pending_request is not None else None
        pool = pass_over(candidate_replicas, avoid)
        near = self.apply_locality_routing(pending_request)  # Serve's: this node's, this zone's, all
        pool = [r for r in pool if r.replica_id in near] or pool
        return [random.sample(pool, min(2, len(pool)))]
