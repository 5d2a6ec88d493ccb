"""Shared fixtures: tiny random-weight models made locally (no hub is reachable), and the
session's device (docs/development.md#tests-on-a-gpu)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Mapping

import pytest

# Tests must never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

GPU_ENV = "PDSERVE_TEST_GPU"
# A GPU session holds many engines in one process (module fixtures, P/D pairs, a plain and a
# speculating engine); each sizes its KV cache from this share of the card instead of 0.9,
# so that they all fit (engine.worker.worker.kv_budget_bytes still measures and checks it).
GPU_TEST_SHARE = 0.02


def session_device(environ: Mapping[str, str], cuda_available: Callable[[], bool]) -> str:
    """The device of this session: "cuda" only when the run asks for the GPU subset
    (PDSERVE_TEST_GPU=1) and a CUDA GPU is there, else "cpu". `cuda_available` is called only
    when asked, so the default run never initializes CUDA."""
    asked = environ.get(GPU_ENV) or "0"
    if asked not in ("0", "1"):
        raise pytest.UsageError(f"{GPU_ENV} must be 0 or 1, got {asked!r}")
    return "cuda" if asked == "1" and cuda_available() else "cpu"


def device_environ(device: str) -> dict[str, str]:
    """What a session on `device` sets before torch and Triton load. On CPU: GPUs hidden (so
    `device="auto"` is the CPU on every machine) and Triton kernels in Triton's interpreter,
    which must be set before triton is first imported. On CUDA: nothing, Triton compiles."""
    return {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"} if device == "cpu" else {}


def gpu_markexpr(markexpr: str) -> str:
    """The -m expression of a run that asked for the GPU subset: only gpu-marked tests, since
    the rest of the suite needs the interpreter and hidden GPUs (the default run has them)."""
    return f"({markexpr}) and gpu" if markexpr.strip() else "gpu"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# Decided when this file is imported, before any test module or lower conftest imports torch
# (tests/actors/conftest.py imports the engine).
DEVICE = session_device(os.environ, _cuda_available)
os.environ.update(device_environ(DEVICE))
if DEVICE == "cuda":
    os.environ.pop("TRITON_INTERPRET", None)  # a shell's setting would hide the compiled kernels


# Modules whose tests ask an app the session shares (tests/cluster/conftest.py): the shared
# app of each mode (`shared_app`), or the P/D app with direct streaming and engine cores in
# processes of their own (`shared_direct_app`). Under pytest-xdist (the README's test command
# runs two workers) one worker runs each group whole, so each app starts once; every other
# module goes to a worker whole. Each group is keyed by the fixture its modules ask.
SHARED_APP_GROUPS = {
    "shared_app": frozenset({
        "tests/cluster/test_lm_eval.py",
        "tests/cluster/test_responses.py",
        "tests/cluster/test_serve_limits.py",
        "tests/cluster/test_serve_lora.py",
        "tests/cluster/test_serve_scoring.py",
        "tests/cluster/test_serve_tools.py",
        "tests/cluster/test_serve_kv_routing.py",
    }),
    "shared_direct_app": frozenset({
        "tests/cluster/test_churn.py",
        "tests/cluster/test_pd_fallback.py",
        "tests/cluster/test_serve_migration.py",
        "tests/cluster/test_serve_pd.py",
        "tests/cluster/test_serve_pd_direct.py",
        "tests/cluster/test_serve_spec.py",
    }),
}


def work_unit(nodeid: str) -> str:
    """The unit the xdist scheduler hands a worker whole: the test's module, or the group of
    modules sharing an app (named by that app's fixture)."""
    path = nodeid.split("::", 1)[0]
    return next((group for group, modules in SHARED_APP_GROUPS.items() if path in modules), path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByModuleAndSharedApp(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByModuleAndSharedApp(config, log)


def unique_nodeids(nodeids: list[str], names: list[str]) -> list[str]:
    """Each item's node id, made unique where several items share one: schemathesis names its
    items `test[POST /v1/completions]` but gives them all the function's node id, and xdist
    keys its work by node id, so under two workers 12 of test_http_fuzz's 13 operations never
    ran. A shared id takes the item's own name as its last part."""
    counts = Counter(nodeids)
    out = [f"{n.rsplit('::', 1)[0]}::{name}" if counts[n] > 1 else n for n, name in zip(nodeids, names, strict=True)]
    still = sorted(n for n, k in Counter(out).items() if k > 1)
    if still:
        raise pytest.UsageError(f"duplicate test ids: {still}")
    return out


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item, nodeid in zip(items, unique_nodeids([i.nodeid for i in items], [i.name for i in items]), strict=True):
        if nodeid != item.nodeid:
            _set_nodeid(item, nodeid)


def _set_nodeid(item, nodeid: str) -> None:
    """pytest has no public setter; xdist and the reports read what this sets (pytest 9.2 keeps
    a structured `_id`, older ones the string `_nodeid`, which is what schemathesis sets)."""
    if hasattr(item, "_id"):
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(nodeid)
    else:
        item._nodeid = nodeid


def xdist_worker_index(environ: Mapping[str, str]) -> int:
    """0 outside xdist or on its first worker ("gw0"), N on worker "gwN"."""
    name = environ.get("PYTEST_XDIST_WORKER", "")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0


def serve_port_ranges(worker: int) -> dict[str, str]:
    """Serve's direct-ingress port ranges for the Ray of xdist worker `worker`: each worker
    starts its own Ray, and two Serve controllers would hand out the same ports (Serve retries
    on a port in use, but a disjoint range never needs to). Worker 0 keeps Serve's defaults."""
    if worker == 0:
        return {}
    if worker > 9:
        raise pytest.UsageError("at most 10 xdist workers: their Serve port ranges would overlap")
    # Serve's defaults are 30000-31000 (HTTP) and 40000-41000 (gRPC): worker N takes 900 ports
    # N thousand above each, so ten workers fit below the next range.
    http, grpc = 30100 + 1000 * worker, 40100 + 1000 * worker
    return {"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http + 899),
            "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(grpc),
            "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(grpc + 899)}


def pytest_configure(config):
    if os.environ.get(GPU_ENV) == "1":
        config.option.markexpr = gpu_markexpr(config.option.markexpr or "")


def pytest_report_header(config):
    if DEVICE == "cuda":
        return f"pdserve: gpu-marked tests on CUDA, Triton compiled ({GPU_ENV}=1)"
    return "pdserve: CPU session (CUDA hidden, Triton interpreted)"


@pytest.fixture(scope="session")
def device() -> str:
    """The device tests put their tensors and engines on: "cuda" in a GPU session (which
    runs only gpu-marked tests), else "cpu"."""
    return DEVICE


def with_test_share(kv_budget_bytes: Callable[..., int]) -> Callable[..., int]:
    """engine.worker.worker.kv_budget_bytes as a GPU session calls it: at most GPU_TEST_SHARE
    of the card, whatever gpu_memory_utilization the engine asked for."""

    def budget(total, free, reserved, allocated, peak, utilization, *rest) -> int:
        return kv_budget_bytes(total, free, reserved, allocated, peak, min(utilization, GPU_TEST_SHARE), *rest)

    return budget


@pytest.fixture(scope="session", autouse=True)
def gpu_engines_share_the_card():
    """In a GPU session, every engine sizes its KV cache from GPU_TEST_SHARE of the card."""
    if DEVICE != "cuda":
        yield
        return
    import engine.core  # noqa: F401 - first: engine.worker.worker imported on its own is an import cycle
    from engine.worker import worker

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(worker, "kv_budget_bytes", with_test_share(worker.kv_budget_bytes))
        yield


@pytest.fixture(autouse=True)
def gpu_memory_freed_after_each_test():
    """In a GPU session, engines a test dropped give their KV cache back before the next test
    sizes its own (an engine's reference cycles keep it alive until collected)."""
    yield
    if DEVICE == "cuda":
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


def shared_cache_dir(basetemp, under_xdist: bool) -> str:
    """The run's pdserve cache: beside the workers' base temps under xdist (one directory for
    the run), inside the base temp otherwise."""
    root = basetemp.parent if under_xdist else basetemp
    path = root / "pdserve-cache"
    path.mkdir(exist_ok=True)
    return str(path)


@pytest.fixture(scope="session", autouse=True)
def pdserve_cache(tmp_path_factory):
    """A private pdserve cache for the session (GGUF tokenizers converted by the tests land
    here, not in the user's ~/.cache). Set before Ray starts, so replicas inherit it. The
    xdist workers of one run share it (their base temp's parent): the compiled CPU kernels
    (~8 CPU-s) and SmolLM2's converted tokenizer (5-15 s) are made once, not once per worker;
    both are written under a private name and renamed, so concurrent makers are safe."""
    path = shared_cache_dir(tmp_path_factory.getbasetemp(), "PYTEST_XDIST_WORKER" in os.environ)
    old = os.environ.get("PDSERVE_CACHE")
    os.environ["PDSERVE_CACHE"] = path
    yield path
    if old is None:
        os.environ.pop("PDSERVE_CACHE", None)
    else:
        os.environ["PDSERVE_CACHE"] = old


@pytest.fixture(scope="session")
def smollm2() -> str:
    """The default model's GGUF file (SmolLM2-135M-Instruct, Q4_1), from the installed package."""
    from engine.models.default_model import default_model

    return default_model()


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """make(family="llama", preset="tiny", **config_overrides) -> model dir, cached per session."""
    from engine.models.make_model import make_model

    cache: dict[tuple, str] = {}

    def make(family: str = "llama", preset: str = "tiny", max_shard_bytes=None, **overrides) -> str:
        key = (family, preset, max_shard_bytes, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"model-{family}-{preset}")
            cache[key] = make_model(str(out), preset, family, max_shard_bytes=max_shard_bytes, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(model_factory) -> str:
    return model_factory("llama")


# Ray's and Serve's own telemetry, which no test reads (the suite never asks Ray's state API,
# its dashboard or Serve's ray_serve_* metrics; pdserve's /metrics are its own): reported every
# minute instead of every 1-10 s, Serve's cached metrics exported every second instead of every
# 0.1 s by each replica, and the event loops' stats and debug dumps off. The suite's two Rays
# run alongside every test. Measured on one worker's Ray with an idle tiny P/D app (2-core CPU,
# two runs each): 5.9-6.1 CPU-s per 30 s with the defaults, 5.0-5.7 with Ray's intervals
# (the dashboard agent's process sampling every 2.5 s alone 0.35 -> 0.12), 4.8-5.2 with
# Serve's too; the app's deployment 21-22 CPU-s against 19-20.5.
QUIET_RAY = {
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    "REPORTER_UPDATE_INTERVAL_MS": "60000",
    "RAY_metrics_report_interval_ms": "60000",
    "RAY_task_events_report_interval_ms": "60000",
    "RAY_raylet_report_resources_period_milliseconds": "1000",
    "RAY_debug_dump_period_milliseconds": "0",
    "RAY_event_stats": "0",
}


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the session: fixed small CPU count, no dashboard, shut down after."""
    from cluster.launch.serve_env import configure_serve_env

    before = set(os.environ)
    # A stopping direct-ingress replica keeps serving for this long so HAProxy can stop sending
    # it requests (pdserve's 2 s, cluster/launch/http_proxy.py). The suite's apps answer through Serve's
    # own proxy, and it stops dozens of replicas (deleted apps, scale-downs, replacements).
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "0.2")
    # Serve's own control loop period (pdserve serve sets 0.5 s to save an idle server's CPU,
    # cluster/launch/serve_env.py): every app start, deletion and replacement takes several
    # turns of it, and the suite makes dozens; 0.1 s saves 1-2 s on each.
    os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.1")
    for name, value in serve_port_ranges(xdist_worker_index(os.environ)).items():
        os.environ.setdefault(name, value)
    for name, value in QUIET_RAY.items():
        os.environ.setdefault(name, value)
    # Serve's switches as `pdserve serve` sets them, for the processes this Ray starts (they
    # take the environment of its start).
    configure_serve_env()
    import ray

    # address="local": always a fresh instance, never a cluster another process recorded in
    # /tmp/ray/ray_current_cluster (bare ray.init() would join it, or wait on it if it is gone).
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    # This process calls deployment handles from plain (not async) test code, which Serve's
    # throughput mode (routers on the caller's event loop) refuses: it keeps Serve's defaults,
    # as a user's own script attached to the cluster does.
    for name in set(os.environ) - before:
        del os.environ[name]
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def llava_model(tmp_path_factory) -> str:
    """A tiny random LLaVA (CLIP + projector + Llama) with its processor, once per session."""
    from engine.models.make_llava import make_llava

    return make_llava(str(tmp_path_factory.mktemp("model-llava")))
