"""The Coordinator deployment: the board of replica load, elastic scaling and autoscaling.

Engine replicas report their figures with every routing-stats round (cluster.replica.server); the
board keeps the latest report of each live replica and forgets replicas that stopped (they say
so when they shut down, or go stale). The ingress forwards `POST /scale`, `GET /status` and
reads the board for `/metrics`. Replica counts change through Serve (cluster.control.serve_control);
while a change is converging (replicas starting, or draining and stopping) the coordinator
answers further scale requests with 409. With autoscaling on, a loop applies the pure
policy in cluster.control.autoscale every `interval_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from cluster.control.autoscale import PolicyState, RoleSignal, build_config, decide
from cluster.control.capacity import describe, free_resources, needed_for, shortfall
from cluster.control.metrics_merge import Snapshot, add
from cluster.control.results import ReplicaStatus, ScaleResult, Status
from cluster.report import ReplicaReport
from cluster.roles import Role

logger = logging.getLogger(__name__)

# A scale target not reached in this long is reported as stuck (and new targets accepted).
SCALE_TIMEOUT_S = 120.0
# A replica that has not reported for this long is gone (reports come every ~0.5 s).
STALE_AFTER_S = 10.0
DEPLOYMENTS = {Role.PREFILL: "Prefill", Role.DECODE: "Decode", Role.COLOCATED: "Colocated"}


class ScaleRequestError(ValueError):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def parse_scale_request(body: object, roles: tuple[str, ...], max_replicas: dict[str, int]) -> dict[str, int]:
    """{role: count} from a `POST /scale` body, or ScaleRequestError(400) naming the field."""
    roles = tuple(str(r) for r in roles)
    if not isinstance(body, dict) or not body:
        raise ScaleRequestError(400, f"body must be a JSON object with counts for {list(roles)}, "
                                     f"e.g. {{\"{roles[0]}\": 2}}")
    unknown = sorted(set(body) - set(roles))
    if unknown:
        raise ScaleRequestError(400, f"unknown role {unknown[0]!r}; this app scales {list(roles)}", unknown[0])
    targets = {}
    for role, n in body.items():
        hi = max_replicas[role]
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= hi:
            raise ScaleRequestError(400, f"{role} must be an integer in [1, {hi}], got {n!r}", role)
        targets[role] = n
    return targets


@dataclass
class Board:
    stale_after_s: float = STALE_AFTER_S
    _reports: dict[str, tuple[float, ReplicaReport]] = field(default_factory=dict)

    def report(self, report: ReplicaReport, now: float | None = None) -> None:
        self._reports[report.replica] = (time.monotonic() if now is None else now, report)

    def forget(self, replica: str) -> None:
        self._reports.pop(replica, None)

    def live(self, now: float | None = None) -> list[ReplicaReport]:
        now = time.monotonic() if now is None else now
        for key in [k for k, (t, _) in self._reports.items() if now - t > self.stale_after_s]:
            del self._reports[key]
        return [report for _, report in sorted(self._reports.values(), key=lambda r: r[1].replica)]

    def signals(self, targets: dict[str, int], now: float | None = None) -> dict[str, RoleSignal]:
        """The autoscaler's view of each role: sums of queues, the worst KV usage and p90s."""
        out = {}
        live = self.live(now)
        for role, n in targets.items():
            reps = [r for r in live if r.role == role]

            def worst(values):
                values = [v for v in values if v is not None]
                return max(values) if values else None

            out[role] = RoleSignal(replicas=n, waiting=sum(r.engine.waiting for r in reps),
                                   running=sum(r.engine.running for r in reps),
                                   kv_usage=worst(r.engine.kv_usage for r in reps) or 0.0,
                                   ttft_p90_s=worst(r.ttft_p90_s for r in reps),
                                   itl_p90_s=worst(r.itl_p90_s for r in reps))
        return out


class Coordinator:
    """Serve deployment body (one replica)."""

    def __init__(self, mode: str = "pd", app_name: str = "pdserve", targets: dict | None = None,
                 max_replicas: dict | None = None, autoscale: dict | None = None, control=None,
                 scale_timeout_s: float = SCALE_TIMEOUT_S, replica_resources: dict | None = None,
                 cluster_autoscaling: bool = False, resources=None, deployments: dict | None = None) -> None:
        self.mode = mode
        # role -> the Serve deployment of its replicas (colocated or decode ones are the
        # ingress's with direct streaming, cluster.replica.server)
        self.deployments = dict(deployments or DEPLOYMENTS)
        self.app_name = app_name
        self.roles = (Role.PREFILL, Role.DECODE) if mode == "pd" else (Role.COLOCATED,)
        self.targets = {r: int((targets or {}).get(r, 1)) for r in self.roles}
        self.max_replicas = {r: int((max_replicas or {}).get(r, 8)) for r in self.roles}
        self.autoscale = build_config(autoscale, self.max_replicas)
        self.board = Board()
        # Each ingress replica's latest request metrics; kept after it stops (cluster.control.metrics_merge).
        # One small snapshot per ingress replica ever started.
        self.ingress_metrics: dict[str, Snapshot] = {}
        if control is None:
            from cluster.control.serve_control import ServeControl

            control = ServeControl(app_name)
        self.control = control
        self.scaling = False
        self._synced = False
        self._sync_task: asyncio.Task | None = None
        self.stuck: str | None = None
        self.scale_timeout_s = scale_timeout_s
        # What one engine replica reserves, whether an autoscaler may add nodes, and where free
        # resources are read (injected in tests).
        self.replica_resources = dict(replica_resources or {})
        self.cluster_autoscaling = cluster_autoscaling
        self._free = resources or free_resources
        self._scaling_since = 0.0
        self._scale_lock = asyncio.Lock()
        self._policy = PolicyState()
        self._autoscaler: asyncio.Task | None = None
        self._store = None
        # LoRA adapters loaded or unloaded at run time on some ingress replica: name -> path
        # (None: unloaded), which every ingress replica follows (cluster.http.lora.follow).
        self.lora_adapters: dict[str, str | None] = {}

    # ---- the board --------------------------------------------------------------------------
    async def report(self, report: ReplicaReport) -> None:
        # async: Serve runs sync methods on a thread pool; the board and the autoscaler task
        # belong to this replica's event loop.
        self.board.report(report)
        self._sync_soon()
        if self.autoscale.enabled and (self._autoscaler is None or self._autoscaler.done()):
            self._autoscaler = asyncio.get_running_loop().create_task(self._autoscale_forever())

    async def forget(self, replica: str) -> None:
        self.board.forget(replica)

    async def replicas(self) -> list[ReplicaReport]:
        return self.board.live()

    # ---- LoRA adapters changed at run time (cluster.http.lora) ---------------------------------
    async def lora_set(self, name: str, path: str | None) -> None:
        self.lora_adapters[name] = path

    async def lora_table(self) -> dict[str, str | None]:
        return dict(self.lora_adapters)

    # ---- the ingress replicas' request metrics (cluster.control.metrics_merge) ---------------------
    async def report_ingress_metrics(self, ingress_id: str, snapshot: Snapshot) -> None:
        self.ingress_metrics[ingress_id] = snapshot
        self._sync_soon()

    async def scrape(self, ingress_id: str, snapshot: Snapshot) -> tuple[list[ReplicaReport], Snapshot]:
        """For `GET /metrics` on `ingress_id`, which sends its fresh snapshot: the engine
        replicas' figures and the request metrics of every ingress replica, summed."""
        self.ingress_metrics[ingress_id] = snapshot
        return self.board.live(), add(self.ingress_metrics.values())

    # ---- scaling ----------------------------------------------------------------------------
    def _sync_soon(self) -> None:
        """Start the sync below when the first report arrives, not on the first /status or
        /scale: Serve's status call costs ~2 s the first time in this process (idle machine),
        and a loaded machine took it past the ingress's 10 s bound on /status (a 503)."""
        if not self._synced and self._sync_task is None:
            self._sync_task = asyncio.get_running_loop().create_task(self._locked_sync())

    async def _locked_sync(self) -> None:
        async with self._scale_lock:
            await self._sync_targets()

    async def _sync_targets(self) -> None:
        """Once: adopt the replica counts Serve runs now. Serve keeps externally set counts
        when this coordinator restarts, so the configured ones may be stale."""
        if self._synced:
            return
        self._synced = True
        try:
            states = await self.control.replica_states()
        except asyncio.CancelledError:  # the next /status or /scale syncs instead
            self._synced = False
            raise
        except Exception:  # Serve busy: keep the configured targets
            logger.exception("could not read Serve's replica counts")
            return
        for role in self.roles:
            counts = states.get(self.deployments[role], {})
            live = sum(n for state, n in counts.items() if state not in ("STOPPING", "STOPPED"))
            if live and live != self.targets[role]:
                logger.info("%s runs %d replicas (configured %d): adopting it", role, live, self.targets[role])
                self.targets[role] = live

    async def _refresh_scaling(self) -> bool:
        """Whether a change is still converging (callers hold `_scale_lock`, so the targets
        cannot change under the check)."""
        if not self.scaling:
            return False
        if await self.control.settled({self.deployments[r]: n for r, n in self.targets.items()}):
            self.scaling = False
            self.stuck = None
            logger.info("scaling done: %s", self.targets)
        elif time.monotonic() - self._scaling_since > self.scale_timeout_s:
            # E.g. a replica that can never be placed: report it and accept new targets
            # rather than refusing every later change.
            self.scaling = False
            self.stuck = f"target {self.targets} not reached within {self.scale_timeout_s:.0f} s"
            logger.warning("scaling stuck: %s", self.stuck)
        return self.scaling

    async def apply(self, targets: dict[str, int], source: str) -> None:
        logger.info("%s scale %s -> %s", source, self.targets, {**self.targets, **targets})
        self._scaling_since = time.monotonic()
        for role, n in targets.items():
            if n != self.targets[role]:
                self.scaling = True
                await self.control.set_replicas(self.deployments[role], n)  # raises if Serve refuses
                self.targets[role] = n
        self.scaling = True

    async def scale(self, body: object) -> ScaleResult:
        """`POST /scale`: accepted (202, the target); 400 bad input; 409 while another change
        is in progress, the autoscaler owns the counts or the target does not fit."""
        try:
            targets = parse_scale_request(body, self.roles, self.max_replicas)
        except ScaleRequestError as e:
            return ScaleResult.refuse(e.status, e.message, "invalid_request_error", e.param)
        async with self._scale_lock:
            await self._sync_targets()
            if self.autoscale.enabled:
                return ScaleResult.refuse(409, "autoscaling is on: it owns the replica counts", "conflict")
            if await self._refresh_scaling():
                return ScaleResult.refuse(409, f"a scale to {self.targets} is still in progress; retry when "
                                               f"GET /status says scaling is false", "conflict")
            added = {r: n - self.targets[r] for r, n in targets.items()}
            needed = needed_for(added, self.replica_resources)
            if needed and not self.cluster_autoscaling:
                free = await asyncio.to_thread(self._free)
                if shortfall(needed, free):
                    return ScaleResult.refuse(
                        409, f"target {({**self.targets, **targets})} does not fit the cluster: the added "
                             f"replicas {describe(needed, free)} (and no autoscaler adds nodes)", "conflict",
                        needed=needed, free=free)
            try:
                await self.apply(targets, "manual")
            except Exception as e:  # e.g. the app was deployed without external scaling
                logger.exception("scale %s failed", targets)
                return ScaleResult.refuse(503, f"Serve refused the change: {type(e).__name__}: {e}",
                                          "service_unavailable")
        return ScaleResult.accept(self.targets)

    # ---- status -----------------------------------------------------------------------------
    async def _store_stats(self) -> dict:
        import ray

        if self.mode != "pd" or not ray.is_initialized():
            return {"live_transfers": 0, "bytes": 0}

        from kvstore.store_actor import find_app_store

        try:
            if self._store is None:
                self._store = find_app_store(self.app_name)
                if self._store is None:
                    return {"live_transfers": 0, "bytes": 0, "error": "KV store not created yet"}
            s = await self._store.stats.remote()
            return {"live_transfers": s["live_transfers"], "bytes": s["bytes"]}
        except Exception as e:  # not created yet, or gone: report what we know
            self._store = None
            return {"live_transfers": 0, "bytes": 0, "error": f"{type(e).__name__}: {e}"}

    async def status(self) -> Status:
        async with self._scale_lock:
            await self._sync_targets()
            await self._refresh_scaling()
        live = self.board.live()
        return Status(self.mode, {role: [ReplicaStatus.of(r) for r in live if r.role == role] for role in self.roles},
                      await self._store_stats(), self.scaling, dict(self.targets), self.autoscale.enabled,
                      self.stuck, await self._pending() if self.scaling else None)

    async def _pending(self) -> dict | None:
        """While scaling: the replicas not running yet, and the resources they wait for."""
        try:
            states = await self.control.replica_states()
            free = await asyncio.to_thread(self._free) if self.replica_resources else {}
        except Exception as e:  # Serve or Ray busy: say so rather than fail /status
            return {"reason": f"unknown ({type(e).__name__}: {e})"}
        missing = {r: max(0, n - states.get(self.deployments[r], {}).get("RUNNING", 0)) for r, n in self.targets.items()}
        if not any(missing.values()):
            return {"reason": "replicas stopping", "replicas": missing}
        needed = needed_for(missing, self.replica_resources)
        short = shortfall(needed, free)
        if short:
            who = "the cluster autoscaler to add nodes" if self.cluster_autoscaling else "resources to free up"
            return {"reason": f"waiting for {who}: {describe(needed, free)}", "replicas": missing,
                    "needed": needed, "free": free, "short": short}
        return {"reason": "replicas starting", "replicas": missing}

    async def __del__(self) -> None:
        """When the whole app is being deleted (however: `pdserve serve` exiting, `serve
        delete`, a config without it), remove its KV store actor, which is detached so that
        no replica's restart takes it down. A restart of this coordinator alone keeps it."""
        if self.mode != "pd":
            return
        try:
            if await self.control.app_deleting():
                from kvstore.store_actor import remove_app_store

                remove_app_store(self.app_name)
        except Exception:  # shutting down: best effort
            logger.exception("could not remove the KV store of %s", self.app_name)

    # ---- autoscaling -------------------------------------------------------------------------
    async def autoscale_tick(self) -> dict[str, int]:
        """One policy step; returns the counts it changed (nothing while a change converges)."""
        async with self._scale_lock:
            await self._sync_targets()
            if await self._refresh_scaling():
                return {}
            self._policy, changes = decide(self.autoscale, self._policy, self.board.signals(self.targets))
            if changes:
                await self.apply(changes, "autoscale")
            return changes

    async def _autoscale_forever(self) -> None:
        while True:
            await asyncio.sleep(self.autoscale.interval_s)  # the policy's tick, not synchronisation
            try:
                await self.autoscale_tick()
            except Exception:  # a failed tick must not end autoscaling
                logger.exception("autoscale tick failed")
