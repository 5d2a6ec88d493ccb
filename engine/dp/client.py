"""DPEngineClient: what the LLMEngine drives instead of one EngineCore when
data_parallel_size > 1 (engine.core_client.make_core_client picks it).

Requests go to the core the coordinator picks (least loaded; waves for lockstep groups);
aborts to the core that holds the request. The messages, calls, bounded waits and failure
handling are every core client's (engine.core_client.client.CoresClient); a core that dies
fails the whole group: its peers may sit in a collective with it, so they are stopped too.
"""

from __future__ import annotations

import time

from engine.config import EngineConfig
from engine.core import check_parallel, resolve_device
from engine.core_client.client import CoresClient
from engine.core_client.messages import AddRequest, CoreStep, StartWaveRequest, WaveComplete
from engine.dp import mp_cores  # noqa: F401  (registers the "mp" backend)
from engine.dp.coordinator import DPCoordinator
from engine.dp.cores import dp_backend
from engine.kv_cache.kv_routing import prompt_block_hashes
from engine.kv_connector import KVConnectorFactory
from engine.request import Request


class DPEngineClient(CoresClient):
    def __init__(self, config: EngineConfig, kv_connector_factory: KVConnectorFactory | None = None) -> None:
        parallel = config.parallel
        super().__init__(config, parallel.data_parallel_size)
        # Here, before any core starts, so a bad size is the user's ParameterError.
        check_parallel(self.arch, resolve_device(config.model.device), parallel)
        self.coordinator = DPCoordinator(self.size, parallel.lockstep)
        self.cores = dp_backend(parallel.dp_backend)(config, kv_connector_factory, self._inbox)
        self._wait_started()

    def label(self, rank: int | None = None) -> str:
        return "data-parallel cores" if rank is None else f"data-parallel core {rank}"

    def _send(self, rank: int, message: object) -> None:
        self.cores.send(rank, message)

    def _route(self, request: Request) -> int:
        kv = None
        cache = self.config.cache
        if cache.enable_kv_cache_events and cache.enable_prefix_caching:
            self.refresh_kv_index()
            lora = request.lora_request.lora_name if request.lora_request is not None else None
            kv = (self.kv_index, prompt_block_hashes(request.prompt_token_ids, cache.block_size, request.cache_salt,
                                                     lora, request.mm_features))
        rank, wave, starts = self.coordinator.route(kv)
        for target, start in starts:
            self.cores.send(target, start)
        self.cores.send(rank, AddRequest(request, wave, time.monotonic() - request.arrival_time))
        return rank

    def _on_step(self, message: CoreStep) -> None:
        self.coordinator.on_figures(message.rank, message.waiting, message.running)

    def _handle_other(self, message) -> None:
        if isinstance(message, WaveComplete):
            self.coordinator.on_wave_complete(message.wave)
        elif isinstance(message, StartWaveRequest):
            for target, start in self.coordinator.on_start_wave_request(message.rank, message.wave):
                self.cores.send(target, start)
        else:
            super()._handle_other(message)

    def _stop_cores(self) -> None:
        self.cores.shutdown()

    def _check_cores(self) -> None:
        self.cores.check_health()

    def _exited_core(self) -> str | None:
        return self.cores.exited()

    def core_pids(self) -> list[int]:
        return self.cores.pids()

    def core_actors(self) -> list:
        return self.cores.actor_handles()
