"""What crosses between a front end and engine cores that run apart from it (a child process,
data-parallel cores): typed, small, and one message per core step (deltas only, as
EngineCoreOutputs are). The wave messages are data parallelism's (engine.dp): a lone core never
sees them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.kv_cache.events import KVEventBatch
from engine.load import EngineLoad
from engine.request import Request, RequestStatus
from engine.sched.output import EngineCoreOutput

# ---- front end -> core ------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    request: Request
    # Data parallel: the wave the front end believes current. A core that already finished it
    # (and paused) asks for a new one (docs/parallel.md#data-parallel). A lone core ignores it.
    wave: int = 0
    # How long the request has waited since it arrived at the front end: the core's clock
    # may be another machine's, so the arrival time is carried as an age.
    queued_for_s: float = 0.0


@dataclass(frozen=True)
class AbortRequests:
    request_ids: tuple[str, ...]
    status: RequestStatus = RequestStatus.FINISHED_ABORTED


@dataclass(frozen=True)
class StartWave:
    """Every core joins wave `wave` (lockstep groups: a request arrived while they paused)."""

    wave: int


@dataclass(frozen=True)
class CoreCall:
    """Run `method(*args)` on the EngineCore between steps; answered with a CallResult."""

    call_id: int
    method: str
    args: tuple = ()


@dataclass(frozen=True)
class Shutdown:
    pass


# ---- core -> front end ------------------------------------------------------------------


@dataclass(frozen=True)
class CoreReady:
    rank: int
    max_model_len: int
    num_kv_blocks: int
    vocab_size: int


@dataclass(frozen=True)
class CoreStep:
    """What one step of core `rank` produced, and its queue figures after it."""

    rank: int
    outputs: list[EngineCoreOutput]
    waiting: int
    running: int
    # Requests scheduled for the first time in this step: their time in the queue.
    queue_times: dict[str, float] = field(default_factory=dict)
    # The core's load figures (CoreLoop.figures), when they changed since the last message.
    figures: EngineLoad | None = None
    # What its prefix cache stored and dropped in the step (engine.kv_cache.events), when KV
    # events are on: the front end's index of its cores (data-parallel routing) follows them.
    kv_events: KVEventBatch | None = None


@dataclass(frozen=True)
class Heartbeat(CoreStep):
    """A core that sent nothing else for HEARTBEAT_S is alive (engine.core_client.watchdog). A
    step with no outputs, so whatever reads steps may take it as one; the client drops it once
    noted, so an idle front end does not pile them up."""


@dataclass(frozen=True)
class WaveComplete:
    """Sent by core 0: every core was idle at the end of wave `wave`; they paused."""

    wave: int


@dataclass(frozen=True)
class StartWaveRequest:
    """Core `rank` got a request for wave `wave`, which it had already finished."""

    rank: int
    wave: int


@dataclass(frozen=True)
class CallResult:
    rank: int
    call_id: int
    value: Any = None
    error: str | None = None


@dataclass(frozen=True)
class CoreFailed:
    rank: int
    message: str
