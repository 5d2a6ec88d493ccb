"""engine.core_client.make_core_client: the config picks where the core runs, and every kind
answers the same questions (CoreClient). The tokens each kind produces are checked against
transformers elsewhere (test_engine_core_process, test_data_parallel, test_parity)."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.core_client import make_core_client
from engine.core_client.client import CoreProcClient
from engine.dp.client import DPEngineClient
from engine.load import EngineLoad
from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.engine.dp_standins import ThreadCores

ENGINE = dict(max_model_len=64, num_kv_blocks=16)


def _config(model: str, **parallel) -> EngineConfig:
    from engine import EngineArgs

    return EngineArgs(model=model, **ENGINE, **parallel).create_engine_config()


def test_by_default_the_core_is_the_client_in_this_process(tiny_model):
    core = make_core_client(_config(tiny_model))
    try:
        assert type(core) is EngineCore and not core.runs_apart
        assert core.core_pids() == [] and core.core_actors() == [] and core.rank_actors() == []
        load = core.load()
        assert isinstance(load, EngineLoad) and load.free_blocks == load.total_blocks == 16
        assert load.data_parallel == ()
    finally:
        core.shutdown()


def test_a_core_process_is_its_own_client_kind_not_a_data_parallel_group(tiny_model):
    """One core apart from its front end runs no coordinator, no waves and reports no
    per-core figures: it is not data parallelism of size one."""
    client = make_core_client(_config(tiny_model, engine_core_process=True))
    try:
        assert type(client) is CoreProcClient and not isinstance(client, DPEngineClient)
        assert client.runs_apart and not hasattr(client, "coordinator")
        [pid] = client.core_pids()
        client.add_request(Request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2), 2))
        done = []
        for _ in range(1000):  # bounded: two steps of a tiny model
            done += [o for o in client.step() if o.finished]
            if done:
                break
        assert [o.request_id for o in done] == ["r"] and not client.has_unfinished_requests()
        fresh = client.load()
        assert fresh.free_blocks == fresh.total_blocks and fresh.data_parallel == ()
        assert "the engine core process" in client.label()
    finally:
        client.shutdown()
    assert not client.process.proc.is_alive() and pid > 0


def test_several_cores_are_a_data_parallel_client_with_per_core_figures(tiny_model, monkeypatch):
    import engine.dp.client as client_module

    monkeypatch.setattr(client_module, "dp_backend", lambda name: ThreadCores)
    client = make_core_client(_config(tiny_model, data_parallel_size=2))
    try:
        assert type(client) is DPEngineClient and client.runs_apart
        assert [core.rank for core in client.load().data_parallel] == [0, 1]
    finally:
        client.shutdown()
