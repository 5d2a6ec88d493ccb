"""Several KV connectors as one (vLLM's MultiConnector idea): e.g. a P/D replica's transfer
connector and its engine's host tier.

Every hook goes to every connector, in order. For a prompt, the first connector that matches
external tokens wins: it alone is told the tokens it loads, the others are told none; a failed
load follows the winner's failure policy. A finished request's blocks are held while any
connector holds them, and freed once each of those reported its save done.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv_connector import GroupBlockIds, KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from engine.kv_transfer_params import KVTransferParams
from engine.request import Request
from engine.sched.output import KVConnectorOutput, SchedulerOutput


@dataclass
class MultiMetadata(KVConnectorMetadata):
    metas: list = field(default_factory=list)  # one per connector, in order
    # Finished requests held by more than one connector: how many must report them sent.
    holders: dict[str, int] = field(default_factory=dict)


class MultiConnector(KVConnectorBase):
    def __init__(self, role: KVConnectorRole, connectors: list[KVConnectorBase]) -> None:
        super().__init__(role)
        if not connectors:
            raise ValueError("MultiConnector needs at least one connector")
        self.connectors = connectors
        # Without a load of its own, a request follows the first connector's policy.
        self.kv_load_failure_policy = connectors[0].kv_load_failure_policy
        # scheduler side
        self._winner: dict[str, int] = {}  # request id -> connector whose tokens it loads
        self._holders: dict[str, int] = {}
        # worker side
        self._need: dict[str, int] = {}  # request id -> saves still to be reported

    # ---- scheduler side -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        # Each connector is asked (one may release a transfer it learns is not needed).
        answers = [c.get_num_new_matched_tokens(request, num_computed_tokens) for c in self.connectors]
        for i, (n, load_async) in enumerate(answers):
            if n > 0:
                self._winner[request.request_id] = i
                return n, load_async
        self._winner.pop(request.request_id, None)
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: GroupBlockIds, num_external_tokens: int) -> None:
        winner = self._winner.get(request.request_id)
        for i, c in enumerate(self.connectors):
            c.update_state_after_alloc(request, block_ids, num_external_tokens if i == winner else 0)

    def load_failure_policy(self, request_id: str) -> str:
        winner = self._winner.get(request_id)
        return (self.kv_load_failure_policy if winner is None
                else self.connectors[winner].load_failure_policy(request_id))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MultiMetadata:
        meta = MultiMetadata([c.build_connector_meta(scheduler_output) for c in self.connectors], self._holders)
        self._holders = {}
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for c in self.connectors:
            c.update_connector_output(output)

    def request_finished(self, request: Request, block_ids: GroupBlockIds) -> tuple[bool, KVTransferParams | None]:
        holders, params = 0, None
        for c in self.connectors:
            delay, p = c.request_finished(request, block_ids)
            holders += delay
            params = params if params is not None else p
        self._winner.pop(request.request_id, None)
        if holders > 1:
            self._holders[request.request_id] = holders
        return holders > 0, params

    def take_kv_events(self) -> list:
        return [event for c in self.connectors for event in c.take_kv_events()]

    def kv_held(self) -> dict[str, tuple[bytes, ...]]:
        held: dict[str, tuple[bytes, ...]] = {}
        for c in self.connectors:
            for medium, hashes in c.kv_held().items():
                held[medium] = held.get(medium, ()) + tuple(hashes)
        return held

    # ---- worker side --------------------------------------------------------------------
    def _metas(self, metadata: MultiMetadata | None) -> list:
        return metadata.metas if metadata is not None else [None] * len(self.connectors)

    def register_kv_caches(self, kv_caches: list, layer_groups: list[int] | None = None) -> None:
        for c in self.connectors:
            c.register_kv_caches(kv_caches, layer_groups)

    def set_wakeup(self, callback: Callable[[], None]) -> None:
        for c in self.connectors:
            c.set_wakeup(callback)

    def start_load_kv(self, metadata: MultiMetadata | None) -> None:
        if metadata is not None:
            self._need.update(metadata.holders)
        for c, m in zip(self.connectors, self._metas(metadata)):
            c.start_load_kv(m)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for c in self.connectors:
            c.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: object, attn_metadata: object) -> None:
        for c in self.connectors:
            c.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self, metadata: MultiMetadata | None) -> None:
        for c, m in zip(self.connectors, self._metas(metadata)):
            c.wait_for_save(m)

    def get_finished(self) -> KVConnectorOutput:
        merged = KVConnectorOutput()
        for c in self.connectors:
            out = c.get_finished()
            merged.finished_recving |= out.finished_recving
            merged.failed_recving.update(out.failed_recving)
            for rid in out.finished_sending:
                left = self._need.get(rid, 1) - 1
                if left > 0:
                    self._need[rid] = left
                else:
                    self._need.pop(rid, None)
                    merged.finished_sending.add(rid)
        return merged

    def transfer_stats(self) -> dict[str, int | float]:
        stats: dict[str, int | float] = {}
        for c in self.connectors:
            stats.update(c.transfer_stats())
        return stats

    def pending_exports(self) -> int:
        return sum(c.pending_exports() for c in self.connectors)
