"""Shared fixtures: tiny random-weight models made locally (no hub is reachable)."""

from __future__ import annotations

import os

import pytest

# Tests must never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite is a CPU suite on every machine (GPU checks are the scripts in scripts/): hide
# GPUs and run the Triton kernels in Triton's interpreter, which must be set before triton is
# first imported.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def pdserve_cache(tmp_path_factory):
    """A private pdserve cache for the session (GGUF tokenizers converted by the tests land
    here, not in the user's ~/.cache). Set before Ray starts, so replicas inherit it."""
    path = str(tmp_path_factory.mktemp("pdserve-cache"))
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


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the session: fixed small CPU count, no dashboard, shut down after."""
    from cluster.launch.serve_env import configure_serve_env

    before = set(os.environ)
    # A stopping direct-ingress replica keeps serving for this long so HAProxy can stop sending
    # it requests (pdserve's 2 s, cluster/http/front.py). The suite's apps answer through Serve's
    # own proxy, and it stops dozens of replicas (deleted apps, scale-downs, replacements).
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "0.2")
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
