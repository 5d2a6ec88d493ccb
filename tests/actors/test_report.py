"""cluster.roles.Role and cluster.report.ReplicaReport: plain values every layer above the engine
can compare, key, print and ship."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

from cluster.report import ReplicaReport
from cluster.roles import Role
from engine.load import EngineLoad, LoRAFigures


def test_a_role_is_its_string_for_comparison_keys_and_printing():
    assert Role.PREFILL == "prefill" and {"prefill": 1}[Role.PREFILL] == 1 and {Role.DECODE: 2}["decode"] == 2
    assert f"{Role.DECODE}-x" == "decode-x" and str(Role.COLOCATED) == "colocated"
    assert json.dumps({Role.PREFILL: [Role.DECODE]}) == '{"prefill": ["decode"]}'
    assert pickle.loads(pickle.dumps(Role.DECODE)) is Role.DECODE
    assert Role.of("prefill") is Role.PREFILL and Role.PREFILL.pd_role == "producer"
    assert Role.DECODE.pd_role == "consumer" and Role.COLOCATED.pd_role is None


def test_an_unknown_role_is_refused_naming_the_roles():
    with pytest.raises(ValueError, match=r"role must be one of \['colocated', 'prefill', 'decode'\], got 'x'"):
        Role.of("x")


def test_routers_read_the_queues_and_the_report_number():
    report = ReplicaReport("decode-1", Role.DECODE, EngineLoad(waiting=2, running=5), seq=7)
    assert report.routing_stats() == {"waiting": 2, "running": 5, "seq": 7, "loras": []}
    # With enable_lora, the adapters the engine holds (the router prefers them).
    held = dataclasses.replace(report, engine=EngineLoad(lora=LoRAFigures(held=("a1", "a2"), max_lora=2)))
    assert held.routing_stats()["loras"] == ["a1", "a2"]
    assert pickle.loads(pickle.dumps(report)) == report  # what crosses Ray to the Coordinator
