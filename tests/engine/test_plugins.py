"""engine.plugins.Registry and the two seams built on it: the executor backends and the
data-parallel backends, each refusing an unregistered name by its engine argument and listing
the names this process has."""

from __future__ import annotations

import pytest

from engine.errors import ParameterError
from engine.plugins import Registry


def test_a_registered_factory_is_returned_and_a_later_registration_replaces_it():
    reg: Registry[type] = Registry("backend", factories={"a": int})
    reg.register("b", str)
    assert reg.get("a") is int and reg.get("b") is str
    reg.register("b", bytes)
    assert reg.get("b") is bytes


def test_an_unknown_name_is_refused_by_field_naming_the_registered_ones_and_the_hint():
    reg: Registry[type] = Registry("backend", "import plugins.x for 'x'", {"b": int, "a": str})
    with pytest.raises(ParameterError) as e:
        reg.get("x")
    assert e.value.field == "backend"
    assert str(e.value) == "backend='x' is not available in this process (available: ['a', 'b']); import plugins.x for 'x'"


def test_the_executor_seam_keeps_its_functions_on_the_shared_registry(monkeypatch):
    from engine import executor

    assert executor.executor_class("uni") is executor.UniProcExecutor
    assert executor.executor_class("mp") is executor.MultiprocExecutor
    monkeypatch.setitem(executor.EXECUTORS.factories, "custom", executor.UniProcExecutor)
    assert executor.executor_class("custom") is executor.UniProcExecutor
    monkeypatch.delitem(executor.EXECUTORS.factories, "custom")
    # 'ray' is there too once anything in this process imported actors.ray_executor.
    with pytest.raises(ParameterError, match=r"available: \['mp', (?:'ray', )?'uni'\].*actors.ray_executor") as e:
        executor.executor_class("custom")
    assert e.value.field == "distributed_executor_backend"


def test_the_data_parallel_seam_keeps_its_functions_on_the_shared_registry(monkeypatch):
    from engine.dp import cores
    from engine.dp.mp_cores import MPCores

    assert cores.dp_backend("mp") is MPCores  # registered by importing engine.dp.mp_cores
    monkeypatch.setitem(cores.BACKENDS.factories, "ray", MPCores)
    cores.register_dp_backend("ray", MPCores)
    assert cores.dp_backend("ray") is MPCores
    monkeypatch.delitem(cores.BACKENDS.factories, "ray")
    with pytest.raises(ParameterError, match="actors.dp_cores") as e:
        cores.dp_backend("ray")
    assert e.value.field == "data_parallel_backend"
