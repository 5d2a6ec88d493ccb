"""Stand-ins for the data-parallel loop and client tests: an EngineCore with no model (each
request runs a fixed number of steps and finishes with one token), and a cores backend whose
cores are threads running the real DPCoreLoop over it."""

from __future__ import annotations

import queue
import threading

from engine.core_client.messages import CoreReady, Shutdown
from engine.dp.core_loop import DPCoreLoop
from engine.dp.cores import DPCores
from engine.load import EngineLoad
from engine.request import Request, RequestStatus
from engine.sched.output import EngineCoreOutput


class StandInCore:
    """Each added request runs `steps` steps and then finishes with one token."""

    def __init__(self, steps: int = 2) -> None:
        self.steps = steps
        self.left: dict[str, int] = {}
        self.dummy_batches = 0
        self.last_step_ran_model = False
        self.idle = False
        self.aborted: list[str] = []

    def execute_dummy_batch(self) -> None:
        self.dummy_batches += 1

    def queue_lengths(self) -> tuple[int, int]:
        return 0, 0  # nothing queues here (the coordinator's routing then spreads by what it sent)

    def num_free_blocks(self) -> int:
        return 16 - len(self.left)

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

    def load(self) -> EngineLoad:
        return EngineLoad(waiting=0, running=len(self.left))


class BarrierControl:
    """The cores' all-reduce, through a barrier shared by the threads."""

    def __init__(self, size: int) -> None:
        self.flags = [False] * size
        self.barrier = threading.Barrier(size, timeout=30)

    def for_rank(self, rank: int):
        control = self

        class One:
            def any(self, flag: bool) -> bool:
                control.flags[rank] = flag
                control.barrier.wait()
                result = any(control.flags)
                control.barrier.wait()
                return result

        return One()


class ThreadCores(DPCores):
    """Each core a DPCoreLoop over a StandInCore on a thread; `sent[r]` records what core r
    was sent, `cores[r]` is its stand-in engine."""

    steps = 3

    def __init__(self, config, kv_connector_factory, outbox: queue.Queue) -> None:
        super().__init__(config, kv_connector_factory, outbox)
        lockstep = config.parallel.lockstep
        control = BarrierControl(self.size) if lockstep else None
        self.cores = [StandInCore(self.steps) for _ in range(self.size)]
        self.inboxes = [queue.Queue() for _ in range(self.size)]
        self.sent: list[list] = [[] for _ in range(self.size)]
        self.loops = [DPCoreLoop(core, r, control.for_rank(r) if control else None, outbox.put, sync_every=2)
                      for r, core in enumerate(self.cores)]
        self.threads = [threading.Thread(target=loop.run, args=(inbox,), daemon=True)
                        for loop, inbox in zip(self.loops, self.inboxes)]
        for rank, thread in enumerate(self.threads):
            outbox.put(CoreReady(rank, 64, 16, 128))
            thread.start()

    def send(self, rank: int, message: object) -> None:
        self.sent[rank].append(message)
        self.inboxes[rank].put(message)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        for inbox in self.inboxes:
            inbox.put(Shutdown())
        for thread in self.threads:
            thread.join(10)
