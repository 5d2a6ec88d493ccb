"""EngineHost: one engine with the KV connector of its role (prefill, decode or colocated).

It owns one engine whose busy loop runs in a background thread (engine.AsyncLLM), and adds
what the cluster needs around it: the KV connector for its role, streaming and one-shot
prefill methods, abort, health and load figures. It is the body of a plain Ray actor
(`start_host_actor`: the P/D flow over actor handles, cluster/pd/actor_peers.py) and the base
of a Serve engine replica (cluster/replica/server.py: EngineServer adds Serve's side). The
engine class is injected (`engine_cls`) so tests can run the host with a fake.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Protocol

import ray
import torch

import actors.dp_cores  # noqa: F401  (registers data_parallel_backend="ray")
import actors.ray_executor  # noqa: F401  (registers distributed_executor_backend="ray")
from cluster.report import ReplicaReport
from cluster.roles import Role
from engine import AsyncLLM, EngineArgs
from engine.engine_client import EngineClient
from engine.engine_request import EngineRequest
from engine.kv_cache.events import KVSnapshot
from engine.kv_connector import KVConnectorRole
from engine.load import EngineLoad, summed_counters
from engine.models.arch import load_arch
from engine.outputs import RequestOutput
from kvstore.connector import PDConnector
from kvstore.connector_factory import PDConnectorFactory
from kvstore.handoff import ExportFailed, KVHandoff
from kvstore.shared_tier import with_shared_tier
from kvstore.store_actor import ADOPT_BOUND_S
from kvstore.transports.object_store import ObjectStoreTransport
from kvstore.transports.relay import KVRelay, RelayConnectorFactory
from kvstore.transports.torch_dist import TorchDistTransport

logger = logging.getLogger(__name__)
_RANK_CALL_TIMEOUT_S = 30.0
# How long a prefill's reply waits for its export to come through a core process's relay
# (normally well under a millisecond behind the output); later, it goes to the store instead.
_HANDBACK_WAIT_S = 5.0
TRANSPORTS = ("object_store", "torch_dist")


class ServingEngine(EngineClient, Protocol):
    """What a host needs of its engine: an EngineClient with a replica's figures and workers.
    engine.AsyncLLM answers it, and tests inject stand-ins that do (`engine_cls=`). The host
    asks nothing else, so it never looks inside the engine for its executor or cores."""

    def generate(self, request: EngineRequest, *, observe: Callable[[RequestOutput], None] | None = None,
                 stream_interval_s: float = 0.0) -> AsyncIterator[RequestOutput]: ...

    async def submit(self, request: EngineRequest, sink: Callable[[object], None]) -> None: ...

    async def load(self) -> EngineLoad: ...

    async def kv_transfer_stats(self) -> dict: ...

    async def kv_outbox_size(self) -> int: ...

    async def kv_snapshot(self) -> KVSnapshot | None: ...

    def core_pids(self) -> list[int]: ...

    def core_actors(self) -> list: ...

    def rank_actors(self) -> list: ...

    def shutdown(self) -> None: ...


def cluster_engine_args(engine_args: EngineArgs) -> EngineArgs:
    """Inside the cluster ranks and data-parallel cores are Ray actors (placed with the replica
    that owns them), not child processes Ray does not know about, unless the args say otherwise."""
    if engine_args.tensor_parallel_size > 1 and engine_args.distributed_executor_backend is None:
        engine_args = dataclasses.replace(engine_args, distributed_executor_backend="ray")
    if engine_args.data_parallel_size > 1 and engine_args.data_parallel_backend is None:
        engine_args = dataclasses.replace(engine_args, data_parallel_backend="ray")
    return engine_args


def engine_config_for_role(engine_args: EngineArgs, role: Role):
    """The engine config a worker of `role` runs: a serving engine's defaults
    (engine.config.resolved_token_budget). A prefill worker samples one token per request,
    so it never speculates (a proposer there would only draft for the decode side); decode
    and colocated workers keep the speculative config."""
    config = engine_args.create_engine_config(usage_context="serving")
    if role == Role.PREFILL:
        config = dataclasses.replace(config, speculative=None)
    return config


class EngineHost:
    kv_tier = False  # its engine's connector has a host tier (set in __init__)
    _shared_store = None  # the app's KV store when the shared tier is on (set in __init__)

    def __init__(
        self,
        engine_args: EngineArgs,
        role: Role | str = Role.COLOCATED,
        replica_id: str | None = None,
        store=None,
        transport: str = "object_store",
        load_failure_policy: str | None = None,
        engine_cls: Callable[..., ServingEngine] = AsyncLLM,
        transport_timeout_s: float = 60.0,
        store_pulls: bool = True,
        handoff_ttl_s: float | None = None,
    ) -> None:
        """`handoff_ttl_s`: how long prompt KV received in a prefill's reply waits for its load
        (kvstore.handoff.Inbox; None: the inbox's default). `load_failure_policy`: None takes
        `engine_args.kv_load_failure_policy`."""
        role = Role.of(role)
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if transport == "torch_dist" and not store_pulls:
            # Its consumers call back into the producer's actor, which a Serve replica is not.
            raise ValueError("transport 'torch_dist' needs plain actors; Serve replicas use 'object_store'")
        self.store_pulls = store_pulls
        self.role = role
        self.replica_id = replica_id or f"{role}-{uuid.uuid4().hex[:8]}"
        engine_args = cluster_engine_args(engine_args)
        load_failure_policy = load_failure_policy or engine_args.kv_load_failure_policy
        tp, dp = engine_args.tensor_parallel_size, engine_args.data_parallel_size
        config = engine_config_for_role(engine_args, role)
        cache = config.cache
        self.kv_tier = config.kv_offload is not None  # its engine's connector has a host tier
        # Block size of the prefix blocks its engine tells of (KV events on), else None.
        self.kv_block_size = cache.block_size if cache.enable_kv_cache_events and cache.enable_prefix_caching else None
        self.transport = None
        self.relay: KVRelay | None = None
        factory = None
        core_end = None  # the relay pipe's end that the core process takes over
        # Both sides of the connector, once made (the worker side's counters are the stats).
        self.connectors: dict[KVConnectorRole, PDConnector] = {}
        if role != Role.COLOCATED:
            if store is None:
                raise ValueError(f"a {role} worker needs the KV store actor (store=...)")
            pd_role = role.pd_role
            if tp > 1 or dp > 1:
                factory = self._remote_factory(transport, pd_role, store, config.cache.block_size,
                                               load_failure_policy, tp, dp, transport_timeout_s,
                                               load_arch(config.model.model).num_kv_heads)
            else:
                self.transport = self._make_transport(transport, store, transport_timeout_s)
                if config.parallel.engine_core_process:
                    # The core is a plain child process: its connector's transport calls are
                    # made here, by this process's transport (kvstore.transports.relay).
                    ours, core_end = mp.get_context("spawn").Pipe()
                    self.relay = KVRelay(self.transport, ours)
                    factory = RelayConnectorFactory(core_end, self.transport.name, pd_role, self.replica_id,
                                                    config.cache.block_size, load_failure_policy)
                else:
                    def factory(side: KVConnectorRole) -> PDConnector:
                        self.connectors[side] = PDConnector(side, pd_role, self.transport, self.replica_id,
                                                            config.cache.block_size, load_failure_policy)
                        return self.connectors[side]

        # The cluster's shared KV tier composes after the P/D connector (and the engine puts
        # its host tier between the two).
        self._shared_store = store if config.kv_shared_tier is not None else None
        factory = with_shared_tier(config, store, self.replica_id, factory)
        try:
            self.engine: ServingEngine = engine_cls(config, factory)
        finally:
            if core_end is not None:
                # The core holds its own copy now: ours closed, the relay sees the core's exit.
                core_end.close()
        if self.transport is not None:
            self.transport.warm_up(producer=role == Role.PREFILL)
        if self.handoff_transport is not None and handoff_ttl_s is not None:
            self.handoff_transport.inbox.ttl_s = handoff_ttl_s

    def _remote_factory(self, transport: str, pd_role: str, store, block_size: int, load_failure_policy: str,
                        tp: int, dp: int, timeout_s: float, num_kv_heads: int) -> PDConnectorFactory:
        """Tensor or data parallel: the connector's sides live in other actors (each rank moves
        its own heads; each data-parallel core schedules its own requests), which build them
        from this recipe. torch_dist: each rank actor is a peer of its own (tensor parallel
        only; data-parallel cores move KV through the object store)."""
        if transport != "object_store" and dp > 1:
            raise ValueError(f"data parallelism with P/D moves KV through the 'object_store' transport; "
                             f"got {transport!r}")
        return PDConnectorFactory(pd_role, store, self.replica_id, block_size, load_failure_policy, tp,
                                  timeout_s, store_pulls=self.store_pulls, num_kv_heads=num_kv_heads,
                                  transport=transport)

    async def _ask_ranks(self, ranks: list, method: str) -> list:
        calls = [getattr(r, method).remote() for r in ranks]
        return list(await asyncio.wait_for(asyncio.gather(*calls), _RANK_CALL_TIMEOUT_S))

    def data_parallel_cores(self) -> list:
        """Handles of this engine's data-parallel core actors (empty without data parallelism
        on Ray)."""
        return self.engine.core_actors()

    def engine_core_pids(self) -> list[int]:
        """Pids of this engine's core processes (engine_core_process, or data-parallel cores on
        the "mp" backend); empty when the core runs in this process."""
        return self.engine.core_pids()

    def _make_transport(self, name: str, store, timeout_s: float):
        def self_handle():
            return ray.get_runtime_context().current_actor

        if name == "object_store":
            return ObjectStoreTransport(store, self.replica_id, self_handle if self.store_pulls else None,
                                        fetch_timeout_s=timeout_s)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return TorchDistTransport(store, self.replica_id, self_handle, device_type=device, timeout_s=timeout_s)

    # ---- requests -----------------------------------------------------------------------
    async def generate(self, request: EngineRequest):
        """Stream RequestOutputs: a Ray streaming generator, for callers of the actor (an async
        generator function, so Ray streams it). Closing it early aborts the request in the
        engine before the close returns. A caller in this process uses `self.engine.generate`."""
        async with aclosing(self.engine.generate(request)) as outputs:
            async for out in outputs:
                yield out

    async def prefill(self, request: EngineRequest) -> RequestOutput:
        """Run a prefill request (cluster.pd.split.prefill_request) to its end; the output
        carries the first token and the kv_transfer_params of the exported prompt KV."""
        last = None
        async for out in self.engine.generate(request):
            last = out
        return last

    @property
    def handoff_transport(self):
        """This replica's one-rank transport when it can hand KV back in a reply and take it
        in from one (kvstore.handoff), else None (tensor or data parallel, torch_dist)."""
        transport = self.transport
        return transport if transport is not None and transport.hands_off else None

    def kv_inbox(self):
        """Where prompt KV handed back in a prefill's reply waits for this engine's load
        (kvstore.handoff.Inbox), or None when this replica cannot take it in (tensor or data
        parallel, torch_dist: the KV then goes through the store)."""
        transport = self.handoff_transport
        return transport.inbox if transport is not None else None

    async def prefill_handoff(self, request: EngineRequest, max_kv_bytes: int | None = None) -> KVHandoff:
        """`prefill`, with the exported prompt KV in the reply instead of the store
        (kvstore.handoff): for a requester that hosts the decode engine itself. Without a
        one-rank object-store transport (tensor or data parallel) the export goes to the
        store as usual and the reply says so (no kv, no error). `max_kv_bytes`: the largest
        KV the requester's channel takes; a bigger one goes to the store too."""
        transport = self.handoff_transport
        if transport is None:
            return KVHandoff(await self.prefill(request))
        transfer_id = request.kv_transfer_params.transfer_id
        transport.handbacks.expect(transfer_id, max_kv_bytes)
        try:
            out = await self.prefill(request)
            if out is None or out.kv_transfer_params is None:
                return KVHandoff(out)  # nothing exported (e.g. it finished at its first token)
            # In process the export came before the output; from a core in a child process it
            # crosses the relay's thread, which may still be on it.
            value = transport.handbacks.poll(transfer_id)
            if value is None:
                value = await asyncio.to_thread(transport.handbacks.take, transfer_id, _HANDBACK_WAIT_S)
        finally:
            transport.handbacks.take(transfer_id)  # aborted or failed: nobody expects it now
        if isinstance(value, torch.Tensor):
            return KVHandoff(out, kv=value)
        if isinstance(value, ExportFailed):
            return KVHandoff(out, error=value.reason)
        return KVHandoff(out)  # DECLINED or None: in the store (too big for a reply, or late)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def take_export(self, transfer_id: str):
        """Called by the KV store (which thereby owns the returned object)."""
        return self.transport.take_export(transfer_id) if self.transport is not None else None

    # torch.distributed transport: pair set-up and sends run off the event loop (they block).
    async def open_pair(self, consumer_id: str) -> None:
        await asyncio.to_thread(self.transport.open_pair, consumer_id)

    async def send_kv(self, transfer_id: str, consumer_id: str, tag: int, readers: int = 1) -> None:
        await asyncio.to_thread(self.transport.send, transfer_id, consumer_id, tag, readers)

    def drop_export(self, transfer_id: str) -> None:
        if self.transport is not None:
            self.transport.drop_export(transfer_id)

    async def outbox_size(self) -> int:
        """Exports this replica still holds for the KV store to take."""
        if self.role == Role.COLOCATED:
            return 0  # no connector anywhere
        if self.transport is not None:
            return self.transport.outbox_size
        ranks = self.engine.rank_actors()
        if ranks:  # each rank moves its own heads, through its own transport
            return sum(await self._ask_ranks(ranks, "outbox_size"))
        return await self.engine.kv_outbox_size()

    # ---- health and load ----------------------------------------------------------------
    async def check_health(self) -> None:
        try:
            await self.engine.check_health()
        except Exception as e:
            raise RuntimeError(f"engine of {self.replica_id} failed: {e}") from e
        if self.relay is not None and not self.relay.alive:
            # Its core's transfers fail from now on (or its core is gone): replace the replica.
            raise RuntimeError(f"the KV relay of {self.replica_id}'s engine core process stopped")

    async def load(self) -> ReplicaReport:
        transport = self.handoff_transport
        # Prompt KV held for a prefill's reply, or received in one and not yet loaded
        # (kvstore.handoff): 0 when idle, or a leak.
        handoffs = len(transport.handbacks) + len(transport.inbox) if transport is not None else 0
        return ReplicaReport(self.replica_id, self.role, await self.engine.load(), handoffs)

    def tensor_parallel_ranks(self) -> list:
        """Handles of this engine's rank actors (empty with one rank): operators and tests
        reach a rank's own state (its KV outbox, its liveness) through them."""
        return self.engine.rank_actors()

    async def shutdown(self) -> None:
        """Stop the engine and release its workers. Call before killing the actor when its
        engine has rank actors: their placement group belongs to the job, not to this actor,
        and would otherwise outlive it."""
        await asyncio.to_thread(self.stop)

    def stop(self) -> None:
        """`shutdown`, blocking (bounded: the engine's and the relay's own bounds)."""
        self.engine.shutdown()
        if self.relay is not None:
            self.relay.close()
        if self._shared_store is not None:
            # Its process owns the objects of the blocks it shared, which would go with it: the
            # store copies them first (bounded), and stops offering what it could not copy
            # before a reader finds it gone.
            try:
                ray.get(self._shared_store.shared_adopt.remote(self.replica_id, ADOPT_BOUND_S),
                        timeout=ADOPT_BOUND_S + 5.0)
            except Exception as e:  # the store gone or slow: its entries are dropped instead
                logger.warning("shared KV tier: the store did not adopt %s's blocks (%s)", self.replica_id, e)
                self._shared_store.shared_drop_owner.remote(self.replica_id)

    def ping(self) -> str:
        return self.replica_id

    def node_id(self) -> str:
        """The Ray node this worker runs on (where a replica landed)."""
        return ray.get_runtime_context().get_node_id()

    async def kv_transfer_stats(self) -> dict:
        """Counters of the KV connector (exports, loads, bytes, load seconds), if any."""
        worker_side = self.connectors.get(KVConnectorRole.WORKER)
        # With a host or shared tier the engine's connector holds the tiers' counters too.
        tiers = self.kv_tier or self._shared_store is not None
        if worker_side is not None and not tiers:
            return dict(worker_side.stats)
        if self.role == Role.COLOCATED and not tiers:
            return {}  # no connector anywhere
        ranks = self.engine.rank_actors()
        if ranks:
            return summed_counters(await self._ask_ranks(ranks, "kv_transfer_stats"))  # each moved its own heads
        return await self.engine.kv_transfer_stats()  # from a core apart (a child process, data parallel)


def start_host_actor(engine_args: EngineArgs, role: Role | str = Role.COLOCATED, num_cpus: float = 0, name: str | None = None,
                  **kwargs):
    """Start an EngineHost actor. Actors default to num_cpus=0 so tests fit on 2 cores."""
    opts = {"num_cpus": num_cpus, "max_concurrency": 1000}
    if name:
        opts["name"] = name
    return ray.remote(EngineHost).options(**opts).remote(engine_args, role, **kwargs)
