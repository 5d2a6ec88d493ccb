"""A fresh KV store and worker factory per actor test (Ray itself: tests/conftest.py)."""

from __future__ import annotations

import pytest

from engine import EngineArgs
from tests.actors.helpers import ENGINE


@pytest.fixture
def pd(ray_local, tiny_model):
    """A fresh store and a factory of workers on it, per test (tests kill actors)."""
    from cluster.replica.host import start_host_actor
    from kvstore.store_actor import create_store

    ray = ray_local
    created = []

    def make(role, store=None, **kw):
        args = EngineArgs(tiny_model, **kw.pop("engine_kwargs", ENGINE))
        actor = start_host_actor(args, role, store=store, **kw)
        ray.get(actor.ping.remote())
        created.append(actor)
        return actor

    store = create_store()
    created.append(store)
    yield ray, store, make
    for actor in created:
        ray.kill(actor)
