"""Serve on local Ray for the HTTP tests: one HTTP proxy on 127.0.0.1 for the session, and an
app per test module (deployed by `deploy`, deleted with its KV store when the module ends, so
an idle app's replicas do not share the two cores with the modules that follow).

The modules that only ask an app questions (scoring, tools, the Responses API, lm-eval, LoRA)
share one app per mode, `shared_app`: starting an app costs 13-17 s on two cores, and ten of
them were a sixth of the suite. Its mode is a session parameter, so pytest runs every test of
one mode together, across those modules, and the app lives through them. The modules that
kill, stop and scale the processes of a P/D app with direct streaming (churn, the decode-only
fallback and the stalled core, the direct P/D path) share one such app, `shared_direct_app`,
which test_serve_pd asks its P/D questions and test_serve_spec asks as its app without
speculation. A shared app goes after the last test of its group."""

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
# The shared apps among them: they outlive a module; `deploy` still deletes them before it
# starts another app, so at most one app runs at a time.
_SHARED: set[str] = set()


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
    for name in [n for n in _DEPLOYED if n not in _SHARED]:
        _delete(name)


@pytest.fixture(scope="session")
def deploy(serve_url):
    """deploy(AppConfig) -> base URL, once /health answers 200; the app is removed at the end."""
    from ray import serve

    from cluster.launch.app import build_app

    def run(cfg=None, *, app_name: str | None = None, application=None, route_prefix: str = "/"):
        """Deploy an AppConfig, or an already built `application` under `app_name`; the URL
        returned is the app's (Serve's, plus `route_prefix`)."""
        name = app_name if application is not None else cfg.app_name
        if cfg is not None:
            # Stopping replicas look for their last requests every 0.2 s instead of Serve's 2 s:
            # the suite stops dozens (deleted apps, scale-downs, replacements).
            cfg = dataclasses.replace(cfg, graceful_shutdown_wait_loop_s=0.2)
        for other in [n for n in _DEPLOYED if n != name]:
            _delete(other)
        serve.run(application if application is not None else build_app(cfg), name=name, route_prefix=route_prefix,
                  blocking=False, external_scaler_enabled=True)
        if name not in _DEPLOYED:
            _DEPLOYED.append(name)
        url = serve_url + route_prefix.rstrip("/")
        wait_http_ok(f"{url}/health")
        return url

    run.url = serve_url
    yield run
    for name in list(_DEPLOYED):
        _delete(name)


@dataclasses.dataclass
class SharedApp:
    """An app several modules share (`shared_app`, `shared_direct_app` below): `url()` deploys
    it again if another module's app replaced it, and otherwise waits until it has settled, so
    a module never starts on a replica that the one before it left being replaced."""

    mode: str
    config: object
    deploy: object

    @property
    def name(self) -> str:
        return self.config.app_name

    @property
    def roles(self) -> set[str]:
        return {"prefill", "decode"} if self.mode == "pd" else {"colocated"}

    def url(self) -> str:
        if self.name not in _DEPLOYED:
            _SHARED.add(self.name)
            return self.deploy(self.config)
        wait_for(lambda: _settled(self.name, self.deploy.url), f"the shared app {self.name} to settle", 180, 0.2)
        return self.deploy.url


def _settled(name: str, url: str) -> bool:
    """Serve runs the app with every replica RUNNING (none starting, stopping or failing its
    health check), and the Coordinator is not scaling it."""
    import requests
    from ray import serve

    app = serve.status().applications.get(name)
    if app is None or app.status != "RUNNING":
        return False
    if any(d.status != "HEALTHY" or set(d.replica_states) != {"RUNNING"} for d in app.deployments.values()):
        return False
    return not requests.get(f"{url}/status", timeout=30).json().get("scaling", False)


# Each work unit's last test id, in the run's order (pytest_runtest_teardown below).
_LAST_OF_GROUP: dict[str, str] = {}


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of a group of modules sharing an app, the shared apps go (the module
    ends below do not delete them), so an idle app does not share the two cores with the
    modules that follow. Under xdist one worker runs a group whole, in collection order."""
    from tests.conftest import SHARED_APP_GROUPS, work_unit

    group = work_unit(item.nodeid)
    if group not in SHARED_APP_GROUPS:
        return
    if not _LAST_OF_GROUP:  # the run's final order, known once its first test has run
        _LAST_OF_GROUP.update({work_unit(i.nodeid): i.nodeid for i in item.session.items})
    if item.nodeid == _LAST_OF_GROUP[group]:
        for name in [n for n in _DEPLOYED if n in _SHARED]:
            _delete(name)


def pytest_collection_modifyitems(config, items):
    """A module that asks a shared app must be in that app's group, or under xdist both
    workers could start it."""
    from tests.conftest import SHARED_APP_GROUPS

    for fixture, modules in SHARED_APP_GROUPS.items():
        unlisted = sorted({item.nodeid.split("::")[0] for item in items if fixture in item.fixturenames} - modules)
        if unlisted:
            raise pytest.UsageError(f"{unlisted} use {fixture}: add them to its group, tests/conftest.py SHARED_APP_GROUPS")


@pytest.fixture(scope="session")
def lora_adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    """PEFT adapters of the tiny model: a1 (served from the start by the shared app), a2 (loaded
    at run time) and big (rank 32, over the shared app's max_lora_rank)."""
    from tests.engine.lora_factory import make_peft_adapter

    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    d = tmp_path_factory.mktemp("http-adapters")
    return {"a1": make_peft_adapter(tiny_model, str(d / "a1"), 8, ["q_proj", "v_proj"], seed=21),
            "a2": make_peft_adapter(tiny_model, str(d / "a2"), 16, every, use_rslora=True, seed=22, scale=0.5),
            "big": make_peft_adapter(tiny_model, str(d / "big"), 32, ["q_proj"], seed=23)}


@pytest.fixture(scope="session", params=["pd", "colocated"])
def shared_app(request, deploy, tiny_model, lora_adapters):
    from tests.cluster.helpers import shared_app_config

    app = SharedApp(request.param, shared_app_config(tiny_model, request.param, lora_adapters["a1"]), deploy)
    yield app
    if app.name in _DEPLOYED:
        _delete(app.name)
    _SHARED.discard(app.name)


# How the modules of the `shared_app` group (tests/conftest.py SHARED_APP_GROUPS) ask it, per
# module: its mode, its base URL (url() settles it or deploys it again first) and an openai
# client. A module with an app of its own defines its own `app` (and `client`), which take
# precedence; one that asked these without being in the group is refused at collection.
@pytest.fixture(scope="module")
def mode(shared_app) -> str:
    return shared_app.mode


@pytest.fixture(scope="module")
def app(shared_app) -> str:
    return shared_app.url()


@pytest.fixture(scope="module")
def client(app):
    from tests.cluster.helpers import openai_client

    return openai_client(app)


@pytest.fixture(scope="session")
def shared_direct_app(deploy, tiny_model):
    """The P/D app with direct streaming and every engine core in a child process, shared by the
    modules that kill, stop and scale its processes (test_churn, test_pd_fallback,
    test_serve_migration, test_serve_pd_direct; each leaves it serving with every role back,
    one replica each), by
    test_serve_pd's requests and by test_serve_spec as its app without speculation: four app
    starts fewer."""
    from tests.cluster.helpers import shared_direct_app_config

    app = SharedApp("pd", shared_direct_app_config(tiny_model), deploy)
    yield app
    if app.name in _DEPLOYED:
        _delete(app.name)
    _SHARED.discard(app.name)

