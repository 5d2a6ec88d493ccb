"""A stand-in EngineCore for the data-parallel loop and client tests: no model, each request
runs a fixed number of steps and finishes with one token."""

from __future__ import annotations

from types import SimpleNamespace

from engine.request import Request, RequestStatus
from engine.sched.output import EngineCoreOutput


class StandInCore:
    """Each added request runs `steps` steps and then finishes with one token."""

    def __init__(self, steps: int = 2) -> None:
        self.steps = steps
        self.left: dict[str, int] = {}
        self.scheduler = SimpleNamespace(waiting=[], running=[])
        self.dummy_batches = 0
        self.executor = SimpleNamespace(execute_dummy_batch=self._dummy)
        self.last_step_ran_model = False
        self.idle = False
        self.aborted: list[str] = []
        self.kv_cache_manager = SimpleNamespace(get_num_free_blocks=lambda: 16 - len(self.left))

    def _dummy(self) -> None:
        self.dummy_batches += 1

    def add_request(self, request: Request) -> None:
        request.first_scheduled_time = request.arrival_time + 0.25
        self.left[request.request_id] = self.steps

    def abort_requests(self, ids, status=RequestStatus.FINISHED_ABORTED) -> None:
        for rid in ids:
            self.left.pop(rid, None)
            self.aborted.append(rid)

    def has_work(self) -> bool:
        return bool(self.left)

    has_unfinished_requests = has_work

    def step(self) -> list[EngineCoreOutput]:
        self.last_step_ran_model = bool(self.left)
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            if self.left[rid] == 0:
                del self.left[rid]
                outs.append(EngineCoreOutput(rid, [7], finish_reason="length"))
        return outs

    def load(self) -> dict:
        return {"waiting": 0, "running": len(self.left)}
