"""The Serve app's KV store outlives whichever replica created it.

A tensor- or data-parallel replica runs in a placement group that captures its child actors,
and Serve removes the group when it stops the replica. The store a replica creates first must
not be placed in that group, or the app loses every transfer with the replica (CI found it:
prefill kept exporting into a store the replaced decode replica could no longer see).
"""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvstore.store_actor import find_app_store, remove_app_store

APP = "lifetime-test"


@ray.remote(num_cpus=0)
class _ReplicaLike:
    def make_store(self) -> None:
        from kvstore.store_actor import app_store

        store = app_store(APP)
        ray.get(store.stats.remote(), timeout=60)


def test_a_store_made_inside_a_capturing_placement_group_survives_the_group(ray_local):
    pg = placement_group([{"CPU": 0.01}], strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_capture_child_tasks=True)
    replica = _ReplicaLike.options(scheduling_strategy=strategy).remote()
    try:
        ray.get(replica.make_store.remote(), timeout=60)
        store = find_app_store(APP)
        assert store is not None
        remove_placement_group(pg)  # what Serve does when it stops the replica
        # Bounded: the replica dies with its group, so wait on its death, then ask the store.
        for _ in range(600):
            try:
                ray.get(replica.make_store.remote(), timeout=1)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                break
        else:
            raise AssertionError("the replica-like actor outlived its placement group")
        assert ray.get(store.stats.remote(), timeout=30)["live_transfers"] == 0
    finally:
        remove_app_store(APP)
