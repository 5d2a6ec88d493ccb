"""Serve on local Ray for the HTTP tests: one HTTP proxy on 127.0.0.1 for the session, and an
app per test module (deployed by `deploy`, deleted with its KV store when the module ends, so
an idle app's replicas do not share the two cores with the modules that follow)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.cluster.helpers import free_port, wait_for, wait_http_ok


@pytest.fixture(scope="session")
def serve_url(ray_local):
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


# Apps deployed and not yet deleted, in deployment order (shared by `deploy` and the module
# teardown below).
_DEPLOYED: list[str] = []


def _delete(name: str) -> None:
    """Delete an app and wait until Serve has stopped it (polled every 50 ms, bounded: Serve's
    own blocking delete looks once a second)."""
    from ray import serve

    from kvstore.store_actor import remove_app_store

    serve.delete(name, _blocking=False)
    wait_for(lambda: name not in serve.status().applications, f"app {name} to be deleted", 60)
    remove_app_store(name)
    _DEPLOYED.remove(name)


@pytest.fixture(scope="module", autouse=True)
def _delete_apps_at_module_end():
    """Set up before a module's own fixtures, so torn down after them: its apps go with it.
    Modules that deploy nothing never import Serve here."""
    yield
    for name in list(_DEPLOYED):
        _delete(name)


@pytest.fixture(scope="session")
def deploy(serve_url):
    """deploy(AppConfig) -> base URL, once /health answers 200; the app is removed at the end."""
    from ray import serve

    from cluster.launch.app import build_app

    def run(cfg=None, *, app_name: str | None = None, application=None):
        """Deploy an AppConfig, or an already built `application` under `app_name`."""
        name = app_name if application is not None else cfg.app_name
        if cfg is not None:
            # Stopping replicas look for their last requests every 0.2 s instead of Serve's 2 s:
            # the suite stops dozens (deleted apps, scale-downs, replacements).
            cfg = dataclasses.replace(cfg, graceful_shutdown_wait_loop_s=0.2)
        for other in [n for n in _DEPLOYED if n != name]:
            _delete(other)
        serve.run(application if application is not None else build_app(cfg), name=name, route_prefix="/",
                  blocking=False, external_scaler_enabled=True)
        if name not in _DEPLOYED:
            _DEPLOYED.append(name)
        wait_http_ok(f"{serve_url}/health")
        return serve_url

    yield run
    for name in list(_DEPLOYED):
        _delete(name)
