"""Local Ray for actor tests: fixed small CPU count, no dashboard, shut down afterwards."""

from __future__ import annotations

import pytest

from tests.actors.helpers import ENGINE


@pytest.fixture(scope="session")
def ray_local():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def pd(ray_local, tiny_model):
    """A fresh store and a factory of workers on it, per test (tests kill actors)."""
    from actors import create_worker
    from kvstore.store_actor import create_store

    ray = ray_local
    created = []

    def make(role, store=None, **kw):
        kw.setdefault("engine_kwargs", ENGINE)
        actor = create_worker(tiny_model, role, store=store, **kw)
        ray.get(actor.ping.remote())
        created.append(actor)
        return actor

    store = create_store(name=None)
    created.append(store)
    yield ray, store, make
    for actor in created:
        ray.kill(actor)
