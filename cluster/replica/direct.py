"""Direct streaming (the default, `--direct-streaming`): an ingress owns its engine.

The HTTP proxy (HAProxy) sends a request straight to an ingress replica, and that replica runs
it on an engine of its own, the colocated engine or in P/D the decode engine (the prompt still
prefills on a Prefill replica; the decode core loads its KV through the relayed transport,
kvstore.transports.relay): the front end (AsyncLLM, detokenization) in the replica's process,
the engine core (scheduler, KV cache, model) in a child process (`engine_core_process`), as
vLLM's API server and EngineCoreProc do, and as Ray Serve LLM's direct streaming skips its
ingress hop. The ingress calls its EngineServer in process (cluster.http.pd_serve's
EngineStreams): no routed call, no per-step Ray message. Figures: docs/pd.md#direct-streaming.

What it gives up: the engine replicas' own router (least load, prefix affinity) for that role:
HTTP requests are spread by the proxy. One ingress replica is one engine replica, so the two
scale together (`colocated_replicas` / `decode_replicas`, POST /scale {"colocated": N} or
{"decode": N}).
"""

from __future__ import annotations

import asyncio
import logging

from cluster.replica.server import EngineServer
from cluster.tasks import detached_task

logger = logging.getLogger(__name__)
# Bound on one figures report (Serve's routing-stats timeout for engine deployments is 5 s).
_REPORT_TIMEOUT_S = 5.0


class DirectEngine:
    """The engine of one ingress replica and its reports to the Coordinator. Serve asks an
    engine deployment's replicas for their figures through its router; nobody routes to an
    ingress replica through Serve, so it reports on its own period."""

    def __init__(self, server_kwargs: dict, report_period_s: float) -> None:
        self.server = EngineServer(**server_kwargs)
        self.report_period_s = report_period_s
        self._reporter: asyncio.Task | None = None

    def kv_inbox(self):
        """The decode engine's KV inbox (kvstore.handoff), or None when its transport has
        none (tensor or data parallel: prompt KV then goes through the store)."""
        return self.server.worker.kv_inbox()

    def start_reporting(self) -> None:
        """Start the figures loop on the running event loop (once)."""
        if self._reporter is None:
            self._reporter = detached_task(self._report_forever())

    async def _report_forever(self) -> None:
        failing = False
        while True:
            try:
                # Forwards to the Coordinator when the figures changed, or as a heartbeat
                # (cluster.replica.server). Bounded as Serve bounds a routing-stats round.
                await asyncio.wait_for(self.server.record_routing_stats(), _REPORT_TIMEOUT_S)
                if failing:
                    logger.warning("engine figures reported again")
                failing = False
            except Exception as e:  # a dead engine: check_health fails and Serve replaces us
                if not failing:  # the Coordinator drops a replica silent for 10 s: say why
                    logger.warning("engine figures not reported: %r", e)
                failing = True
            await asyncio.sleep(self.report_period_s)  # a period, not a wait on an event

    async def check_health(self) -> None:
        self.start_reporting()
        await self.server.check_health()

    async def shutdown(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
            await asyncio.wait([self._reporter], timeout=_REPORT_TIMEOUT_S)
        await self.server.__del__()
