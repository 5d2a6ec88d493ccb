"""EngineServer: the body of the Prefill, Decode and Colocated Serve deployments, and of an
ingress replica's own engine with direct streaming.

It is an EngineHost (cluster/replica/host.py: one engine with the KV connector of its role, in
the replica's process) with Serve's side added: its replica id, the per-step channel to
routed ingresses, latency windows, routing stats and reports to the Coordinator, draining. With direct streaming (the default) the ingress builds one in its
process and calls it there (`generate`: no routed call, no per-step Ray message), as vLLM's
API server calls its EngineCoreProc and as Ray Serve LLM's direct streaming skips its ingress
hop; the HTTP proxy (HAProxy) spreads requests over the ingress replicas, so one ingress
replica is one engine replica and the two scale together. Figures: docs/pd.md#direct-streaming. Serve calls `record_routing_stats` periodically: its figures feed
the request router (least load) and are forwarded to the Coordinator, which keeps the
cluster-wide board behind `/metrics` and `/status`. Serve's `check_health` fails the
replica when its engine thread died, so Serve replaces it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable

from ray import serve

from cluster.replica.caller_watch import while_caller_lives
from cluster.replica.host import EngineHost
from cluster.replica.kv_digest import KVDigest
from cluster.replica.latency import LatencyWindow
from cluster.replica.step_channel import StepHub
from cluster.report import ReplicaReport
from cluster.roles import Role
from cluster.tasks import detached_task
from engine.args import EngineArgs
from engine.engine_request import EngineRequest
from engine.outputs import RequestOutput
from kvstore.store_actor import app_store

logger = logging.getLogger(__name__)

# How long a draining prefill replica waits for decode replicas to fetch its exports (they
# live in its process's object store and go with it).
_EXPORT_DRAIN_S = 30.0
# Bound on one figures report of an ingress's own engine (Serve's routing-stats timeout for
# engine deployments is 5 s).
_REPORT_TIMEOUT_S = 5.0
# Unchanged figures still reach the coordinator this often (it forgets a replica silent for
# cluster.control.coordinator.STALE_AFTER_S = 10 s).
_HEARTBEAT_S = 3.0


class ReplicaGone(RuntimeError):
    """A call meant for a replica that no longer exists reached another one."""


class EngineServer(EngineHost):
    _kv_digest: KVDigest | None = None  # set in __init__ when the engine records KV events
    _stopping = False  # once stopping, off the Coordinator's board: ingresses count it gone
    _reporter: asyncio.Task | None = None  # start_reporting's loop (direct streaming)

    def __init__(self, engine_args: EngineArgs, role: Role | str, app_name: str = "pdserve",
                 load_failure_policy: str = "fail", coordinator: str | None = "Coordinator",
                 store_kwargs: dict | None = None, stream_interval_ms: float = 0.0,
                 latency_window_s: float = 10.0) -> None:
        ctx = serve.get_replica_context()
        self.role = role = Role.of(role)
        self.app_name = app_name
        self.unique_id = ctx.replica_id.unique_id
        self.replica_id = f"{role}-{self.unique_id}"
        # A colocated replica needs the store only for the shared KV tier (kvstore.shared_tier).
        needs_store = role != Role.COLOCATED or engine_args.kv_shared_tier_size is not None
        store = app_store(app_name, **(store_kwargs or {})) if needs_store else None
        self.store = store
        # Serve replicas are not plain actors: the store moves their exports (store_pulls=False).
        # Handed-back KV waits for its load as long as a store transfer's lease would.
        super().__init__(engine_args, role, self.replica_id, store, "object_store", load_failure_policy,
                         store_pulls=False, handoff_ttl_s=(store_kwargs or {}).get("lease_s"))
        self._coordinator = (serve.get_deployment_handle(coordinator, app_name)
                             if coordinator else None)
        self._seq = 0
        self._forwarded: ReplicaReport | None = None  # the report last sent to the coordinator, and when
        self._forwarded_at = 0.0
        # Latency as this replica sees it (the autoscaler's signals): time to the first token
        # of a prefill (queue + compute) and gaps between streamed tokens.
        self.ttft = LatencyWindow(latency_window_s)
        self.itl = LatencyWindow(latency_window_s)
        # Routed requests' latency observers (`_latency_observer`), by request id.
        self._observers: dict[str, Callable[[RequestOutput], None]] = {}
        # Least time between two streamed outputs of a request, in process (generate) as over
        # the per-step channel (the hub): a chunk then carries several tokens.
        self.stream_interval_s = stream_interval_ms / 1000.0
        self.hub = StepHub(self.stream_interval_s, on_output=self._observe)
        # Its cached prefix blocks for KV-aware routers, when its engine records KV events.
        self._kv_digest = None if self.kv_block_size is None else KVDigest(self.kv_block_size)

    # ---- requests (called through DeploymentHandles) -------------------------------------
    async def prefill(self, request: EngineRequest) -> RequestOutput:
        """Run a prefill request (cluster.pd.split.prefill_request) to its end; its output
        carries the first token and the export's kv_transfer_params (the KV is in the store)."""
        start = time.monotonic()
        out = await super().prefill(request)
        self.ttft.add(time.monotonic() - start)
        return out

    async def prefill_handoff(self, request: EngineRequest, max_kv_bytes: int | None = None):
        """`prefill` with the prompt KV in the reply (kvstore.handoff): for a direct-streaming
        ingress, whose own decode engine loads it, and whose channel takes up to
        `max_kv_bytes` of KV."""
        start = time.monotonic()
        handoff = await super().prefill_handoff(request, max_kv_bytes)
        self.ttft.add(time.monotonic() - start)
        return handoff

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """One request's outputs, for a caller in this process (a direct-streaming ingress): the
        engine's own stream (AsyncLLM.generate), at most one output per stream interval but the
        first and the last; closing it early aborts the request in the engine (and frees its
        KV blocks) before the close returns. A dead engine raises EngineDeadError (a 503 with
        Retry-After: the ingress validated the request). The latency windows see each engine
        step's output, as for a routed request."""
        return self.engine.generate(request, observe=self._latency_observer(),
                                    stream_interval_s=self.stream_interval_s)

    # ---- per-step messages (cluster.replica.step_channel) ----------------------------------------
    async def submit(self, request: EngineRequest, ingress_id: str, avoid: list[str] | None = None) -> str:
        """Queue a request whose outputs go to `ingress_id`'s subscription; returns this
        replica's id, which the ingress names in `subscribe` and `abort`. `avoid` is the
        router's (cluster.replica.router: replicas it passed over)."""
        request_id = request.request_id
        sink = self.hub.sink(ingress_id, request_id)
        self._observers[request_id] = self._latency_observer()
        try:
            await self.engine.submit(request, sink)
        except BaseException:
            self.hub.forget(request_id)
            self._observers.pop(request_id, None)
            raise
        return self.unique_id

    async def subscribe(self, ingress_id: str, replica: str, caller=None):
        """Stream of lists of RequestDeltas for `ingress_id` (a Serve streaming method); its
        requests here are aborted once `caller` (the ingress's actor handle, when it sent one)
        died (cluster.replica.caller_watch)."""
        self._check_target(replica)
        async for batch in while_caller_lives(self.hub.subscribe(ingress_id, super().abort), caller):
            yield batch

    def _latency_observer(self) -> Callable[[RequestOutput], None]:
        """What one request's engine steps tell the latency windows: the gaps between its
        tokens, and (colocated: its prompt ran here) the time to its first."""
        start, last = time.monotonic(), None

        def observe(out: RequestOutput) -> None:
            nonlocal last
            if not out.delta_token_ids:
                return
            now = time.monotonic()
            if last is not None:
                self.itl.add(now - last)
            elif self.role == Role.COLOCATED:
                self.ttft.add(now - start)
            last = now

        return observe

    def _observe(self, out: RequestOutput) -> None:
        """The per-step channel's outputs, to their request's observer."""
        observe = self._observers.get(out.request_id)
        if observe is None:
            return
        observe(out)
        if out.finished:
            del self._observers[out.request_id]

    def _check_target(self, replica: str | None) -> None:
        # The router sends a call naming a replica there; if that replica is gone it lands
        # elsewhere, and must not act on another replica's requests.
        if replica is not None and replica != self.unique_id:
            raise ReplicaGone(f"replica {replica} is gone (this is {self.unique_id})")

    async def abort(self, request_id: str, replica: str | None = None) -> None:
        self._check_target(replica)
        self.hub.forget(request_id)
        self._observers.pop(request_id, None)
        await super().abort(request_id)

    # ---- health, load and metrics (check_health, load: EngineHost's) --------------------
    def placement_group_id(self) -> str | None:
        """The placement group of this replica (hex id; None without one)."""
        import ray

        return ray.get_runtime_context().get_placement_group_id() or None

    def processes(self) -> dict:
        """This replica's pid and its engine core processes' (--engine-core-process; none
        when the core runs in the replica's own process), and its id as its reports name it
        (/status), for operators and tests."""
        import os

        return {"replica": os.getpid(), "engine_cores": self.engine_core_pids(), "id": self.replica_id}

    async def report(self) -> ReplicaReport:
        """This replica's figures now (unnumbered)."""
        report = await self.load()
        return dataclasses.replace(report, kv_transfer=await self.kv_transfer_stats(),
                                   ttft_p90_s=self.ttft.percentile(0.9), itl_p90_s=self.itl.percentile(0.9))

    async def record_routing_stats(self) -> dict:
        """Serve's routing-stats hook: the report goes to the Coordinator, its queues to the
        request routers (Serve's contract is a dict)."""
        self._seq += 1
        same = await self.report()
        kv = None
        if self._kv_digest is not None:
            kv = self._kv_digest.of(await self.engine.kv_snapshot())
            same = dataclasses.replace(same, kv_cached_blocks=dict(self._kv_digest.counts))
        report = dataclasses.replace(same, seq=self._seq, time=time.time())
        now = time.monotonic()
        # Serve asks every routing_stats_period_s; an idle replica's figures do not change, so
        # the coordinator hears of them only when they do, or as a heartbeat (it drops a
        # replica silent for STALE_AFTER_S).
        if self._coordinator is not None and not self._stopping and (
                same != self._forwarded or now - self._forwarded_at >= _HEARTBEAT_S):
            self._forwarded, self._forwarded_at = same, now
            # Fire and forget: a slow or restarting coordinator must not stall routing stats.
            self._coordinator.report.remote(report)
        stats = report.routing_stats()
        if kv is not None:
            stats["kv"] = kv
        return stats

    # ---- in an ingress's process (direct streaming) -------------------------------------
    def start_reporting(self, period_s: float) -> None:
        """Report this replica's figures to the Coordinator every `period_s` (once started).
        Serve asks an engine deployment's replicas for their figures through its router;
        nobody routes to an ingress replica through Serve, so one that runs its own engine
        (direct streaming: the ingress builds this server in its process) reports itself."""
        if self._reporter is None:
            self._reporter = detached_task(self._report_forever(period_s))

    async def _report_forever(self, period_s: float) -> None:
        failing = False
        while True:
            try:
                # Forwards to the Coordinator when the figures changed, or as a heartbeat.
                # Bounded as Serve bounds a routing-stats round.
                await asyncio.wait_for(self.record_routing_stats(), _REPORT_TIMEOUT_S)
                if failing:
                    logger.warning("engine figures reported again")
                failing = False
            except Exception as e:  # a dead engine: check_health fails and Serve replaces us
                if not failing:  # the Coordinator drops a replica silent for 10 s: say why
                    logger.warning("engine figures not reported: %r", e)
                failing = True
            await asyncio.sleep(period_s)  # a period, not a wait on an event

    async def shutdown(self) -> None:
        """Stop this replica: off the Coordinator's board first (ingresses count it gone); a
        prefill replica keeps its process until the decode side fetched what it exported
        (bounded); then the engine stops. Serve has let in-flight requests finish
        (graceful_shutdown_timeout_s) before it calls this (through `__del__`)."""
        self._stopping = True
        if self._reporter is not None:
            self._reporter.cancel()
            await asyncio.wait([self._reporter], timeout=_REPORT_TIMEOUT_S)
        if self._coordinator is not None:
            self._coordinator.forget.remote(self.replica_id)
        if self.role == Role.PREFILL and self.store is not None:
            deadline = time.monotonic() + _EXPORT_DRAIN_S
            while time.monotonic() < deadline:
                try:
                    owned = await self.store.count_owned.remote(self.replica_id)
                except Exception:  # store gone: nothing left to serve
                    break
                if owned == 0:
                    break
                await asyncio.sleep(0.2)  # polling the store while draining, bounded
        self.stop()

    async def __del__(self) -> None:
        # Serve's shutdown hook of a deployment replica.
        await self.shutdown()
