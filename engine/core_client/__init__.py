"""How a front end (LLMEngine) reaches its engine core, chosen from the config as vLLM's core
client is (docs/architecture.md#engine-core-client):

- in process (the default): the EngineCore itself;
- `engine_core_process`: CoreProcClient, one core in a spawned child process;
- `data_parallel_size > 1`: engine.dp.DPEngineClient, several cores in processes or actors.

Every kind answers the `CoreClient` protocol, so the front end never asks which it has.
"""

from __future__ import annotations

from typing import Protocol

from engine.config import EngineConfig
from engine.kv_connector import KVConnectorFactory
from engine.load import EngineLoad
from engine.models.arch import ModelArch
from engine.request import Request, RequestStatus
from engine.sched.output import EngineCoreOutput


class CoreClient(Protocol):
    arch: ModelArch
    max_model_len: int
    num_kv_blocks: int
    # Whether the cores run apart from this process: load(fresh=False) then serves the copies
    # they sent with their steps, from any thread, without waiting for the engine thread.
    runs_apart: bool
    # The last step found nothing to run (all waiting for remote KV or a grammar): the driver
    # may block until woken. A client whose step() waits for its cores is never idle.
    idle: bool
    last_step_ran_model: bool

    def add_request(self, request: Request) -> None: ...
    def abort_requests(self, request_ids: list[str], status: RequestStatus = ...) -> None: ...
    def step(self) -> list[EngineCoreOutput]: ...
    def has_work(self) -> bool: ...
    def has_unfinished_requests(self) -> bool: ...
    def get_num_unfinished_requests(self) -> int: ...
    def wake(self) -> None: ...
    def set_kv_wakeup(self, callback) -> None: ...
    def load(self, fresh: bool = True) -> EngineLoad: ...
    def reset_prefix_cache(self) -> bool: ...
    def kv_transfer_stats(self) -> dict: ...
    def kv_outbox_size(self) -> int: ...
    def give_tokenizer(self, pickled: bytes | None) -> None: ...
    def core_pids(self) -> list[int]: ...
    def core_actors(self) -> list: ...
    def rank_actors(self) -> list: ...
    def check_health(self) -> None: ...
    def shutdown(self) -> None: ...


def make_core_client(config: EngineConfig, kv_connector_factory: KVConnectorFactory | None = None) -> CoreClient:
    parallel = config.parallel
    if parallel.data_parallel_size > 1:
        from engine.dp.client import DPEngineClient

        return DPEngineClient(config, kv_connector_factory)
    if parallel.engine_core_process:
        from engine.core_client.client import CoreProcClient

        return CoreProcClient(config, kv_connector_factory)
    from engine.core import EngineCore

    # The front end that asked for this client gives the core its tokenizer (give_tokenizer).
    return EngineCore(config, kv_connector_factory, tokenizer_from_front_end=True)
