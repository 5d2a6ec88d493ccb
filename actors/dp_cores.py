"""The "ray" data-parallel backend: one Ray actor per engine core (actors.dp_core), all placed
by one placement group. Importing this module registers it (engine.dp.cores); the engine
itself never imports Ray.

Placement: a core with tensor_parallel_size ranks takes tp consecutive bundles (core d: bundles
d*tp ... d*tp + tp - 1; with tp > 1 its "ray" executor puts rank r in bundle d*tp + r). Inside a
Serve replica whose deployment asked for those dp*tp bundles (cluster.launch.app does), the replica's
own group is used, so Serve reserves and replaces the whole group with the replica; anywhere
else the backend makes a STRICT_PACK group of its own and removes it at shutdown.

Failure: a core whose actor dies ends its message stream with an error, which the reader turns
into a CoreFailed at once; the front end then stops every core (a survivor may sit in a
collective with the dead one).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import queue
import threading
import time
import weakref

import ray
import torch
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.dp_core import DPCoreActor
from actors.ray_executor import PLACEMENT_STRATEGY, RayExecutor, rank_bundle, release_actors
from engine.config import EngineConfig
from engine.core import resolve_device
from engine.core_client.client import START_TIMEOUT_S
from engine.core_client.messages import CoreFailed
from engine.distributed import COLLECTIVE_TIMEOUT, DPPlacement
from engine.dp.cores import DPCores, register_dp_backend
from engine.errors import EngineDeadError, ParameterError
from engine.kv_connector import KVConnectorFactory

_HEALTH_TIMEOUT_S = 30.0
_STOP_GRACE_S = 10.0


class RayCores(DPCores):
    def __init__(self, config: EngineConfig, kv_connector_factory: KVConnectorFactory | None,
                 outbox: queue.Queue) -> None:
        super().__init__(config, kv_connector_factory, outbox)
        parallel = config.parallel
        self.tp = parallel.tensor_parallel_size
        if self.tp > 1:
            # A core's ranks are Ray actors too, in the bundles after the core's own.
            if parallel.distributed_executor_backend not in (None, "ray"):
                raise ParameterError("distributed_executor_backend", "data-parallel cores on Ray run their "
                                     "tensor-parallel ranks as Ray actors: distributed_executor_backend must be "
                                     "'ray' (or unset)")
            config = dataclasses.replace(config, parallel=dataclasses.replace(
                parallel, distributed_executor_backend="ray"))
        device = resolve_device(config.model.device).type
        self.actors: list = []
        self._owned: list[PlacementGroup] = []
        self._seq = [itertools.count() for _ in range(self.size)]
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._finalizer = weakref.finalize(self, _release, self.actors, self._owned, self._stopping)
        try:
            pg = self._placement_group(device)
            for rank in range(self.size):
                first = rank * self.tp
                executor_cls = None
                if self.tp > 1:
                    executor_cls = functools.partial(RayExecutor, placement=(pg, first))
                self.actors.append(ray.remote(DPCoreActor).options(
                    num_cpus=0, num_gpus=1 if device == "cuda" and self.tp == 1 else 0, max_concurrency=8,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first),
                ).remote(config, kv_connector_factory, executor_cls))
            world, control = None, None
            if parallel.lockstep:
                world, control = self._wait([self.actors[0].rendezvous.remote()], "rendezvous")[0]
            threads = max(1, torch.get_num_threads() // self.size)
            starts = [a.start.remote(DPPlacement(rank, self.size, world), control,
                                     COLLECTIVE_TIMEOUT.total_seconds(), threads)
                      for rank, a in enumerate(self.actors)]
            ready = self._wait(starts, "start")
        except BaseException:
            self.shutdown()
            raise
        for message in ready:
            outbox.put(message)  # the client waits for every core's CoreReady
        for rank in range(self.size):
            threading.Thread(target=self._read, args=(rank,), name=f"pdserve-dp{rank}-reader", daemon=True).start()

    def _placement_group(self, device: str) -> PlacementGroup:
        need = self.size * self.tp
        current = get_current_placement_group()
        if current is not None and len(current.bundle_specs) == need:
            return current  # a Serve replica's group, sized for this data-parallel group
        pg = placement_group([rank_bundle(device) for _ in range(need)], strategy=PLACEMENT_STRATEGY)
        self._owned.append(pg)
        try:
            ray.get(pg.ready(), timeout=START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise EngineDeadError(f"no room for {self.size} data-parallel cores x {self.tp} ranks "
                                  f"({rank_bundle(device)} each, {PLACEMENT_STRATEGY}) within {START_TIMEOUT_S:.0f} s") \
                from None
        return pg

    def _wait(self, refs: list, what: str) -> list:
        """Every core's answer in rank order; the first failure or the timeout raises."""
        deadline = time.monotonic() + START_TIMEOUT_S
        results: dict[int, object] = {}
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                missing = sorted(rank_of[r] for r in pending)
                raise EngineDeadError(f"data-parallel cores {missing} did not answer {what!r} within "
                                      f"{START_TIMEOUT_S:.0f} s")
            rank = rank_of[done[0]]
            try:
                results[rank] = ray.get(done[0])
            except ray.exceptions.RayError as e:
                raise EngineDeadError(f"data-parallel core {rank} failed in {what!r}:\n{e}") from None
        return [results[r] for r in range(len(refs))]

    def actor_handles(self) -> list:
        """The core actors, in rank order."""
        return list(self.actors)

    def _read(self, rank: int) -> None:
        try:
            for ref in self.actors[rank].messages.remote():
                self.outbox.put(ray.get(ref))
            reason = "its message stream ended"
        except ray.exceptions.RayError as e:
            reason = f"its actor failed: {e}"
        if not self._stopping.is_set():
            self.outbox.put(CoreFailed(rank, f"data-parallel core {rank} is gone ({reason})"))

    def send(self, rank: int, message: object) -> None:
        with self._lock:  # sequence numbers in the order the messages are sent
            self.actors[rank].post.remote(next(self._seq[rank]), message)

    def check_health(self) -> None:
        refs = [a.ping.remote() for a in self.actors]
        try:
            alive = self._wait_health(refs)
        except ray.exceptions.RayError as e:
            raise EngineDeadError(f"a data-parallel core failed its health check: {e}") from None
        dead = [rank for rank, ok in enumerate(alive) if not ok]
        if dead:
            raise EngineDeadError(f"data-parallel cores {dead} stopped stepping")

    def _wait_health(self, refs: list) -> list:
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=_HEALTH_TIMEOUT_S)
        if pending:
            raise EngineDeadError(f"data-parallel cores did not answer a health check within {_HEALTH_TIMEOUT_S:.0f} s")
        return ray.get(refs)

    def shutdown(self) -> None:
        self._finalizer()


def _release(actors: list, owned: list[PlacementGroup], stopping: threading.Event) -> None:
    """Stop every core (bounded: it releases its rank actors), then release_actors."""
    stopping.set()
    stops = []
    for actor in actors:
        try:
            stops.append(actor.stop.remote())
        except Exception:  # Ray is shutting down
            pass
    if stops:
        try:
            ray.wait(stops, num_returns=len(stops), timeout=_STOP_GRACE_S)
        except Exception:
            pass
    release_actors(actors, owned)


register_dp_backend("ray", RayCores)
