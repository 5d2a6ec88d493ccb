"""The suite's split over pytest-xdist workers (tests/conftest.py): whole modules per worker,
each group of modules sharing an app together, and disjoint Serve port ranges per worker's Ray."""

from __future__ import annotations

import os

import pytest

from tests.conftest import (
    SHARED_APP_GROUPS,
    serve_port_ranges,
    shared_cache_dir,
    unique_nodeids,
    work_unit,
    xdist_worker_index,
)


def test_a_module_is_one_unit_and_the_modules_sharing_an_app_are_one_together():
    assert work_unit("tests/engine/test_gguf.py::test_a[x]") == "tests/engine/test_gguf.py"
    assert work_unit("tests/engine/test_gguf.py::TestX::test_b") == "tests/engine/test_gguf.py"
    for group, modules in SHARED_APP_GROUPS.items():
        assert {work_unit(f"{m}::test_q[pd]") for m in modules} == {group}
    assert work_unit("tests/cluster/test_churn.py::test_x") == work_unit("tests/cluster/test_serve_pd_direct.py::t")
    assert work_unit("tests/cluster/test_churn.py::test_x") != work_unit("tests/cluster/test_lm_eval.py::t[pd]")


def test_every_shared_app_module_exists_and_is_in_one_group():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    every = [m for modules in SHARED_APP_GROUPS.values() for m in modules]
    assert all(os.path.isfile(os.path.join(root, m)) for m in every)
    assert len(every) == len(set(every))


def test_items_sharing_a_node_id_get_their_names_and_the_others_keep_theirs():
    ids = ["t.py::test_a", "t.py::test_fuzz", "t.py::test_fuzz", "t.py::test_b[x]"]
    names = ["test_a", "test_fuzz[GET /health]", "test_fuzz[POST /scale]", "test_b[x]"]
    assert unique_nodeids(ids, names) == ["t.py::test_a", "t.py::test_fuzz[GET /health]",
                                          "t.py::test_fuzz[POST /scale]", "t.py::test_b[x]"]
    with pytest.raises(pytest.UsageError, match="duplicate test ids"):
        unique_nodeids(["t.py::test_a", "t.py::test_a"], ["test_a", "test_a"])


def test_worker_index_comes_from_xdists_worker_name():
    assert xdist_worker_index({}) == 0
    assert xdist_worker_index({"PYTEST_XDIST_WORKER": "gw0"}) == 0
    assert xdist_worker_index({"PYTEST_XDIST_WORKER": "gw3"}) == 3
    assert xdist_worker_index({"PYTEST_XDIST_WORKER": "master"}) == 0


def test_workers_serve_ports_do_not_overlap_and_the_first_keeps_serves_defaults():
    assert serve_port_ranges(0) == {}
    spans = []
    for worker in range(1, 10):
        r = serve_port_ranges(worker)
        spans += [(int(r[f"RAY_SERVE_DIRECT_INGRESS_MIN_{p}_PORT"]), int(r[f"RAY_SERVE_DIRECT_INGRESS_MAX_{p}_PORT"]))
                  for p in ("HTTP", "GRPC")]
    spans += [(30000, 31000), (40000, 41000)]  # Serve's defaults, worker 0's
    spans.sort()
    assert all(a[1] < b[0] for a, b in zip(spans, spans[1:])), spans
    with pytest.raises(pytest.UsageError):
        serve_port_ranges(10)


def test_xdist_workers_of_one_run_share_one_pdserve_cache_and_a_plain_run_keeps_its_own(tmp_path):
    run = tmp_path / "pytest-7"
    gw0, gw1 = run / "popen-gw0", run / "popen-gw1"
    gw0.mkdir(parents=True), gw1.mkdir()
    assert shared_cache_dir(gw0, True) == shared_cache_dir(gw1, True) == str(run / "pdserve-cache")
    plain = tmp_path / "pytest-8"
    plain.mkdir()
    assert shared_cache_dir(plain, False) == str(plain / "pdserve-cache")
    assert os.path.isdir(run / "pdserve-cache") and os.path.isdir(plain / "pdserve-cache")
