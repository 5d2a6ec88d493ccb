"""Serve on local Ray for the HTTP tests: one HTTP proxy on 127.0.0.1 for the session, and an
app per test module (deployed by `deploy`, deleted with its KV store afterwards)."""

from __future__ import annotations

import pytest

from tests.cluster.helpers import free_port, wait_http_ok


@pytest.fixture(scope="session")
def serve_url(ray_local):
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="session")
def deploy(serve_url):
    """deploy(AppConfig) -> base URL, once /health answers 200; the app is removed at the end."""
    from ray import serve

    from cluster.app import build_app
    from kvstore.store_actor import remove_app_store

    deployed = []

    def run(cfg=None, *, app_name: str | None = None, application=None):
        """Deploy an AppConfig, or an already built `application` under `app_name`."""
        name = app_name if application is not None else cfg.app_name
        for other in [n for n in deployed if n != name]:
            serve.delete(other)
            remove_app_store(other)
            deployed.remove(other)
        serve.run(application if application is not None else build_app(cfg), name=name, route_prefix="/",
                  blocking=False, external_scaler_enabled=True)
        deployed.append(name)
        wait_http_ok(f"{serve_url}/health")
        return serve_url

    yield run
    for name in deployed:
        serve.delete(name)
        remove_app_store(name)
