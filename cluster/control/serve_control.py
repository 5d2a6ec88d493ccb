"""Replica counts through Ray Serve itself (docs/architecture.md#scaling: no home-made actor pool).

Serve's external-scaling API (the app is deployed with `external_scaler_enabled=True`) is the
controller's `update_deployment_replicas`, which is also what Ray's dashboard endpoint
`POST /api/v1/applications/{app}/deployments/{d}/scale` calls; it is reached here directly
because pdserve runs without the dashboard. Serve then starts replicas (they take traffic once
healthy) or stops them gracefully (no new requests routed to them, in-flight requests finish
within `graceful_shutdown_timeout_s`). Ray-internal names are confined to this module.
"""

from __future__ import annotations

import asyncio

import ray
from ray import serve


class ServeControl:
    def __init__(self, app_name: str) -> None:
        self.app_name = app_name

    def _controller(self):
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)

    async def set_replicas(self, deployment: str, n: int) -> None:
        from ray.serve._private.common import DeploymentID

        await self._controller().update_deployment_replicas.remote(DeploymentID(deployment, self.app_name), n)

    async def replica_states(self) -> dict[str, dict[str, int]]:
        """{deployment: {replica state: count}} of this app, as Serve reports it."""
        status = await asyncio.to_thread(serve.status)
        app = status.applications.get(self.app_name)
        if app is None:
            return {}
        return {name: {str(getattr(s, "value", s)): n for s, n in d.replica_states.items()}
                for name, d in app.deployments.items()}

    async def settled(self, targets: dict[str, int]) -> bool:
        """Every deployment runs exactly its target, none starting or stopping."""
        states = await self.replica_states()
        return all(states.get(name, {}) == {"RUNNING": n} for name, n in targets.items())

    async def app_deleting(self) -> bool:
        """Whether this app is being deleted (as opposed to one replica being replaced)."""
        status = await asyncio.to_thread(serve.status)
        app = status.applications.get(self.app_name)
        return app is None or str(getattr(app.status, "value", app.status)) == "DELETING"
