"""The GPU subset (tests/conftest.py, docs/development.md#tests-on-a-gpu): a session runs on CUDA
only when the run asks (PDSERVE_TEST_GPU=1) and a GPU is there; it then runs only the
gpu-marked tests. Otherwise GPUs are hidden, Triton is interpreted, and every test runs on CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import (
    GPU_ENV,
    GPU_TEST_SHARE,
    device_environ,
    gpu_markexpr,
    session_device,
    with_test_share,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cuda_never_probed() -> bool:
    raise AssertionError("CUDA was probed in a run that did not ask for the GPU")


@pytest.mark.parametrize("environ", [{}, {GPU_ENV: "0"}, {GPU_ENV: ""}])
def test_a_run_that_does_not_ask_is_on_cpu_and_never_probes_cuda(environ):
    assert session_device(environ, _cuda_never_probed) == "cpu"


def test_a_run_that_asks_is_on_cuda_only_when_a_gpu_is_there():
    assert session_device({GPU_ENV: "1"}, lambda: True) == "cuda"
    assert session_device({GPU_ENV: "1"}, lambda: False) == "cpu"


@pytest.mark.parametrize("value", ["yes", "true", "2"])
def test_a_malformed_ask_names_the_variable_and_its_values(value):
    with pytest.raises(pytest.UsageError, match=f"{GPU_ENV} must be 0 or 1, got '{value}'"):
        session_device({GPU_ENV: value}, lambda: True)


def test_a_cpu_session_hides_gpus_and_interprets_triton_and_a_cuda_session_neither():
    assert device_environ("cpu") == {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    assert device_environ("cuda") == {}


@pytest.mark.parametrize("given, expected", [("", "gpu"), ("  ", "gpu"), ("not slow", "(not slow) and gpu")])
def test_a_run_that_asks_selects_only_gpu_tests(given, expected):
    assert gpu_markexpr(given) == expected


def test_a_gpu_run_sizes_each_engines_kv_cache_from_its_small_share():
    import engine.core  # noqa: F401 - first: engine.worker.worker imported on its own is an import cycle
    from engine.worker.worker import kv_budget_bytes

    gib = 2**30
    # An 80 GiB card, empty; a forward pass peaking at 0.1 GiB; the engine asks for 0.9.
    figures = (80 * gib, 80 * gib, 0, 0, gib // 10, 0.9, 0, 0)
    assert kv_budget_bytes(*figures) > 70 * gib
    assert with_test_share(kv_budget_bytes)(*figures) == int(80 * gib * GPU_TEST_SHARE - gib // 10)
    # The real checks still apply: a card already full refuses the engine.
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        with_test_share(kv_budget_bytes)(80 * gib, gib // 100, 0, 0, gib // 10, 0.9, 0, 0)


@pytest.mark.gpu
def test_engines_left_at_auto_run_on_the_sessions_device(device):
    from engine.core import resolve_device

    assert resolve_device("auto").type == device
    if device == "cpu":
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and os.environ["TRITON_INTERPRET"] == "1"
    else:
        assert "TRITON_INTERPRET" not in os.environ


def test_asking_without_a_gpu_selects_the_gpu_subset_and_keeps_it_on_cpu():
    # The child collects this file (cheap to import) and inherits this session's hidden GPUs:
    # a machine without a GPU, wherever it runs.
    env = {**os.environ, GPU_ENV: "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider",
                           "tests/test_gpu_marker.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "pdserve: CPU session (CUDA hidden, Triton interpreted)" in done.stdout
    collected = [line.strip() for line in done.stdout.splitlines() if line.strip().startswith("<Function")]
    assert collected == ["<Function test_engines_left_at_auto_run_on_the_sessions_device>"], done.stdout
    assert "deselected" in done.stdout
