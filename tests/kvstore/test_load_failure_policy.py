"""kv_load_failure_policy (vLLM's name): an engine argument that reaches the decode side's P/D
connector from EngineArgs, from `pdserve serve --kv-load-failure-policy` (and the flag's old
name, --load-failure-policy) and from a Serve config; its refusal counters reach /metrics."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.http.metrics import AppMetrics
from cluster.launch.app_config import AppConfig
from cluster.launch.cli import build_parser
from cluster.launch.serve_cli import _config
from cluster.replica.host import EngineHost
from cluster.report import ReplicaReport
from cluster.roles import Role
from engine.args import EngineArgs
from engine.errors import ParameterError
from engine.kv_connector import KVConnectorRole
from engine.load import EngineLoad
from kvstore.kv_io import REFUSAL_REASONS, refusal_key
from tests.kvstore.helpers import RecordingStore


def test_the_default_is_recompute_and_a_bad_value_names_the_field_and_its_choices():
    assert EngineArgs(model="unused").kv_load_failure_policy == "recompute"
    with pytest.raises(ParameterError, match=r"\('recompute', 'fail'\), got 'retry'") as e:
        EngineArgs(model="unused", kv_load_failure_policy="retry").create_engine_config()
    assert e.value.field == "kv_load_failure_policy"


@pytest.mark.parametrize("argv,policy", [
    ([], "recompute"),
    (["--kv-load-failure-policy", "fail"], "fail"),
    (["--load-failure-policy", "fail"], "fail"),  # the flag's old name
])
def test_serve_flags_set_the_engine_argument(tiny_model, argv, policy):
    cfg = _config(build_parser().parse_args(["serve", "--model", tiny_model, *argv]))
    assert cfg.engine_args.kv_load_failure_policy == cfg.load_failure_policy == policy


def test_a_bad_serve_flag_value_is_refused_by_the_parser(tiny_model):
    for flag in ("--kv-load-failure-policy", "--load-failure-policy"):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["serve", "--model", tiny_model, flag, "retry"])
        assert e.value.code == 2


def test_the_app_configs_old_name_sets_the_engine_argument(tiny_model):
    old = AppConfig(engine_args=EngineArgs(model=tiny_model), load_failure_policy="fail")
    assert old.engine_args.kv_load_failure_policy == old.load_failure_policy == "fail"
    flat = AppConfig.from_flat({"model": tiny_model, "kv_load_failure_policy": "fail"})
    assert flat.load_failure_policy == "fail"
    assert AppConfig(engine_args=EngineArgs(model=tiny_model)).load_failure_policy == "recompute"


class _ConnectorsOnly:
    """A stand-in engine that only builds both sides of the connector it is given."""

    def __init__(self, config, factory) -> None:
        self.sides = [factory(KVConnectorRole.SCHEDULER), factory(KVConnectorRole.WORKER)]


@pytest.mark.parametrize("given,expected", [
    ({}, "recompute"),
    ({"kv_load_failure_policy": "fail"}, "fail"),
])
def test_a_decode_worker_takes_the_policy_from_its_engine_arguments(tiny_model, given, expected):
    worker = EngineHost(EngineArgs(model=tiny_model, **given), "decode", store=RecordingStore(),
                          engine_cls=_ConnectorsOnly, store_pulls=False)
    assert [c.kv_load_failure_policy for c in worker.engine.sides] == [expected, expected]
    explicit = EngineHost(EngineArgs(model=tiny_model, **given), "decode", store=RecordingStore(),
                            engine_cls=_ConnectorsOnly, store_pulls=False, load_failure_policy="fail")
    assert {c.kv_load_failure_policy for c in explicit.engine.sides} == {"fail"}


def test_refusals_reach_metrics_by_reason():
    refused = {refusal_key(r): i + 1 for i, r in enumerate(REFUSAL_REASONS)}
    reports = [ReplicaReport("d-1", Role.of("decode"), EngineLoad(), kv_transfer={"load_failures": 21, **refused}),
               ReplicaReport("p-1", Role.of("prefill"), EngineLoad(), kv_transfer={"exports": 3})]
    families = {f.name: f for f in text_string_to_metric_families(AppMetrics("tiny", "pd").render(reports).decode())}
    family = families["pdserve:kv_transfer_refused"]
    assert family.type == "counter"
    got = {(s.labels["replica"], s.labels["reason"]): s.value for s in family.samples if s.name.endswith("_total")}
    assert got == {**{("d-1", r): float(i + 1) for i, r in enumerate(REFUSAL_REASONS)},
                   **{("p-1", r): 0.0 for r in REFUSAL_REASONS}}
