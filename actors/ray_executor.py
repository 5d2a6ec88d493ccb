"""The "ray" executor: one Ray actor per tensor-parallel rank, placed by a placement group.

Importing this module registers it (`engine.executor.register_executor`); the engine itself
never imports Ray. The contract is the "mp" executor's: the EngineCore's process is the
driver and holds no rank; each call is pickled once and sent inline to every rank;
rank 0 answers with the sampled tokens, every rank with its KV-connector report.

Placement: inside a Serve replica whose deployment asked for `placement_group_bundles` of
tensor_parallel_size bundles (cluster.launch.app does when tp > 1), rank r goes to bundle r of the
replica's own group, so Serve reserves the ranks with the replica and replaces them with it.
Anywhere else (a P/D actor, an offline LLM on Ray) the executor makes a group of its own,
STRICT_PACK (all ranks on one node: the collectives never cross the network), and removes it
at shutdown.

Failure: every wait is bounded. A rank whose actor dies fails the pending call at once
(`ray.wait` returns its reference, whose `ray.get` raises), every rank is killed and the
engine gets an EngineDeadError; a rank that hangs fails the call after _CALL_TIMEOUT_S, and the
collectives inside the ranks time out on their own after _COLLECTIVE_TIMEOUT_S.
"""

from __future__ import annotations

import logging
import pickle
import time
import weakref
from typing import Any

import ray
import torch
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.tp_rank import TPRank
from engine.distributed import COLLECTIVE_TIMEOUT
from engine.errors import EngineDeadError
from engine.executor import register_executor
from engine.executor.base import RankGroupExecutor, WorkerConfig
from engine.executor.kv_aggregate import KVOutputAggregator
from engine.kv_connector import KVConnectorFactory

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 600.0  # placement, actor start, model shard load
_CALL_TIMEOUT_S = 600.0  # the longest step (a full-budget prefill on CPU)
_COLLECTIVE_TIMEOUT_S = COLLECTIVE_TIMEOUT.total_seconds()
_HEALTH_TIMEOUT_S = 30.0
# A CPU rank's threads are counted against its replica's own CPU reservation (as the "mp"
# ranks, child processes, are); the bundle only needs to be non-empty to be placed.
_CPU_RANK_BUNDLE = {"CPU": 0.01}
_GPU_RANK_BUNDLE = {"GPU": 1.0}
PLACEMENT_STRATEGY = "STRICT_PACK"


def rank_bundle(device_type: str) -> dict[str, float]:
    """What one rank reserves: its GPU, or a token share of a CPU."""
    return dict(_GPU_RANK_BUNDLE if device_type == "cuda" else _CPU_RANK_BUNDLE)


def replica_bundles(device_type: str, tp: int, replica_resources: dict[str, float]) -> list[dict[str, float]]:
    """A Serve replica's placement group: bundle 0 holds the replica actor and rank 0, the
    others one rank each (Serve places the replica in bundle 0)."""
    bundles = [rank_bundle(device_type) for _ in range(tp)]
    for name, amount in replica_resources.items():
        if amount:
            bundles[0][name] = bundles[0].get(name, 0.0) + amount
    return bundles


class RayExecutor(RankGroupExecutor):
    def __init__(self, config: WorkerConfig, kv_connector_factory: KVConnectorFactory | None = None,
                 placement: tuple[PlacementGroup, int] | None = None) -> None:
        """`placement` (group, first bundle): where a data-parallel core's ranks go (rank r in
        bundle first + r of a group its backend reserved); None: see the module's docstring."""
        super().__init__(config)
        size = config.engine.parallel.tensor_parallel_size
        self.size = size
        self.kv_outputs = KVOutputAggregator(size)
        self.failure: str | None = None
        self.actors: list = []
        self._owned: list[PlacementGroup] = []
        self._finalizer = weakref.finalize(self, release_actors, self.actors, self._owned)
        try:
            pg, first = placement if placement is not None else (self._placement_group(config.device.type), 0)
            for rank in range(size):
                strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first + rank)
                self.actors.append(ray.remote(TPRank).options(
                    # A health ping and the KV store's pulls are answered while a step runs.
                    num_cpus=0, num_gpus=1 if config.device.type == "cuda" else 0, max_concurrency=4,
                    scheduling_strategy=strategy,
                ).remote(config, rank, size, kv_connector_factory))
            init_method = self._gather([self.actors[0].rendezvous_address.remote()], _START_TIMEOUT_S,
                                       "rendezvous")[0]
            threads = max(1, torch.get_num_threads() // size)
            self._gather([a.start.remote(init_method, _COLLECTIVE_TIMEOUT_S, threads) for a in self.actors],
                         _START_TIMEOUT_S, "start")
        except BaseException:
            self.shutdown()
            raise

    def _placement_group(self, device_type: str) -> PlacementGroup:
        current = get_current_placement_group()
        if current is not None and len(current.bundle_specs) == self.size:
            logger.info("tensor-parallel ranks placed in this replica's placement group %s", current.id.hex())
            return current  # a Serve replica's group (cluster.launch.app): its bundle r is rank r's
        pg = placement_group([rank_bundle(device_type) for _ in range(self.size)], strategy=PLACEMENT_STRATEGY)
        self._owned.append(pg)
        try:
            ray.get(pg.ready(), timeout=_START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise EngineDeadError(
                f"no room for {self.size} tensor-parallel ranks ({rank_bundle(device_type)} each, "
                f"{PLACEMENT_STRATEGY}) within {_START_TIMEOUT_S:.0f} s") from None
        return pg

    def rank_actors(self) -> list:
        """The rank actors, in rank order."""
        return list(self.actors)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        # Pickled once for all ranks and sent inline with each call: a step is a few KB, and a
        # reference to the object store would cost every rank a fetch from this process.
        payload = pickle.dumps((args, kwargs or {}), protocol=pickle.HIGHEST_PROTOCOL)
        refs = [a.call.remote(method, payload) for a in self.actors]
        return self._gather(refs, _CALL_TIMEOUT_S, method)

    def set_kv_wakeup(self, callback) -> None:
        """Not forwarded: the callback lives in this process. While every request waits for
        remote KV the engine loop polls (engine.async_llm._IDLE_POLL_S), and each poll's
        step collects the loads the ranks completed."""

    def check_health(self) -> None:
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        self._gather([a.ping.remote() for a in self.actors], _HEALTH_TIMEOUT_S, "health check")

    def _gather(self, refs: list, timeout_s: float, what: str) -> list[Any]:
        """Every rank's reply in rank order; the first death, error or the timeout fails the
        engine (waiting on each reference as it completes, not in rank order: rank 0 may be
        stuck in a collective with the rank that died)."""
        deadline = time.monotonic() + timeout_s
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                missing = sorted(rank_of[r] for r in pending)
                self._fail(f"tensor-parallel ranks {missing} did not answer {what!r} within {timeout_s:.0f} s")
            rank = rank_of[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                self._fail(f"tensor-parallel rank {rank} (Ray actor) died during {what!r}: {e}")
            except ray.exceptions.RayTaskError as e:
                self._fail(f"tensor-parallel rank {rank} failed in {what!r}:\n{e}")
        return [results[r] for r in range(len(refs))]

    def _fail(self, message: str):
        self.failure = message
        self.shutdown()
        raise EngineDeadError(message)

    def shutdown(self) -> None:
        self._finalizer()


def release_actors(actors: list, owned: list[PlacementGroup]) -> None:
    """Kill every actor (a survivor may sit in a collective with a dead peer) and remove the
    placement groups its owner made, so nothing outlives the engine."""
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone, or Ray is shutting down
            pass
    for pg in owned:
        try:
            remove_placement_group(pg)
        except Exception:
            pass


register_executor("ray", RayExecutor)
