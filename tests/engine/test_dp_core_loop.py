"""One data-parallel core's loop (engine.dp.core_loop) over a stand-in EngineCore: what it
sends, when it steps on no tokens, when a wave ends. The real engine under the same loop is
tests/engine/test_data_parallel.py."""

from __future__ import annotations

import queue

from engine.core_client.messages import (
    AbortRequests,
    AddRequest,
    CallResult,
    CoreCall,
    CoreStep,
    Shutdown,
    StartWave,
    StartWaveRequest,
    WaveComplete,
)
from engine.dp.core_loop import DPCoreLoop
from engine.load import CoreFigures, EngineLoad
from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.engine.dp_standins import StandInCore


class FlagControl:
    """The all-reduce over cores, answered by the test: the other cores' flag."""

    def __init__(self, others_unfinished: bool = False) -> None:
        self.others_unfinished = others_unfinished
        self.calls = 0

    def any(self, flag: bool) -> bool:
        self.calls += 1
        return flag or self.others_unfinished


def _request(rid: str) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=1), 1)


def _control_messages(loop: DPCoreLoop) -> list:
    """What the loop sent besides its steps' outputs and figures."""
    return [m for m in loop.sent if not isinstance(m, CoreStep)]


def _run(loop: DPCoreLoop, *messages) -> list:
    inbox: queue.Queue = queue.Queue()
    for m in (*messages, Shutdown()):
        inbox.put(m)
    loop.run(inbox)
    return loop.sent


def _loop(core, rank=0, control=None, sync_every=4) -> DPCoreLoop:
    sent: list = []
    loop = DPCoreLoop(core, rank, control, sent.append, sync_every=sync_every)
    loop.sent = sent
    return loop


def test_each_step_sends_one_message_with_its_outputs_figures_and_first_queue_times():
    core = StandInCore(steps=1)
    loop = _loop(core)
    inbox: queue.Queue = queue.Queue()
    inbox.put(AddRequest(_request("a"), 0, queued_for_s=0.0))
    inbox.put(AddRequest(_request("b"), 0, queued_for_s=0.0))
    loop._drain(inbox)
    loop._step()
    [msg] = loop.sent
    assert isinstance(msg, CoreStep) and [o.request_id for o in msg.outputs] == ["a", "b"]
    assert msg.queue_times == {"a": 0.25, "b": 0.25}
    assert msg.figures.data_parallel[0].requests == 2  # its figures changed: a copy rides along


def test_without_lockstep_an_idle_core_never_runs_a_dummy_batch():
    core = StandInCore()
    loop = _loop(core)
    inbox: queue.Queue = queue.Queue()
    loop._drain(inbox)  # nothing queued: returns after its bounded wait
    loop._step()
    assert core.dummy_batches == 0 and loop.sent == []


def test_a_core_told_to_start_a_wave_steps_on_no_tokens_until_the_all_reduce_finds_none_busy():
    core, control = StandInCore(), FlagControl(others_unfinished=True)
    loop = _loop(core, rank=0, control=control, sync_every=4)
    inbox: queue.Queue = queue.Queue()
    inbox.put(StartWave(0))
    loop._drain(inbox)
    for _ in range(4):
        loop._step()
    # A busy peer: the wave goes on past the first all-reduce.
    assert core.dummy_batches == 4 and control.calls == 1 and loop.running
    control.others_unfinished = False
    for _ in range(4):
        loop._step()
    assert core.dummy_batches == 8 and control.calls == 2 and not loop.running
    assert _control_messages(loop) == [WaveComplete(0)] and loop.wave == 1
    # The wave's last figures went out before the pause: 8 dummy steps, wave 1.
    assert (loop.sent[-1].figures.data_parallel[0].dummy_steps, loop.sent[-1].figures.data_parallel[0].wave) == (8, 1)
    loop._step()  # paused: no more dummy batches
    assert core.dummy_batches == 8


def test_only_core_zero_reports_the_end_of_a_wave():
    core = StandInCore()
    loop = _loop(core, rank=1, control=FlagControl(), sync_every=1)
    loop.running = True
    loop._step()
    assert not loop.running and loop.wave == 1 and _control_messages(loop) == []


def test_a_busy_core_runs_its_requests_not_dummy_batches():
    core = StandInCore(steps=3)
    loop = _loop(core, control=FlagControl(), sync_every=8)
    inbox: queue.Queue = queue.Queue()
    inbox.put(AddRequest(_request("a"), 0))
    loop._drain(inbox)
    for _ in range(3):
        loop._step()
    assert core.dummy_batches == 0 and loop.running
    for _ in range(5):  # idle until the 8th step's all-reduce ends the wave
        loop._step()
    assert core.dummy_batches == 5 and not loop.running


def test_a_request_for_a_finished_wave_makes_the_paused_core_ask_for_the_next_and_run_it():
    core = StandInCore()
    loop = _loop(core, rank=1, control=FlagControl())
    loop.wave = 3
    inbox: queue.Queue = queue.Queue()
    inbox.put(AddRequest(_request("a"), 2))
    inbox.put(AbortRequests(("a",)))  # even with its request gone, it stays in the wave
    loop._drain(inbox)
    assert _control_messages(loop) == [StartWaveRequest(1, 3)] and loop.running and core.aborted == ["a"]


def test_a_request_tagged_with_a_later_wave_moves_the_core_to_it():
    loop = _loop(StandInCore(), control=FlagControl())
    _run(loop, AddRequest(_request("a"), 5))
    assert loop.wave >= 5 and not any(isinstance(m, StartWaveRequest) for m in loop.sent)


def test_a_stale_start_wave_is_ignored():
    loop = _loop(StandInCore(), control=FlagControl())
    loop.wave = 2
    inbox: queue.Queue = queue.Queue()
    inbox.put(StartWave(1))
    loop._drain(inbox)
    assert not loop.running


def test_calls_are_answered_with_the_cores_figures_and_errors_are_returned_not_raised():
    loop = _loop(StandInCore(), control=FlagControl())
    _run(loop, CoreCall(1, "load"), CoreCall(2, "no_such_method"))
    sent = _control_messages(loop)
    assert sent[0] == CallResult(0, 1, EngineLoad(data_parallel=(CoreFigures(rank=0),)))
    assert sent[1].call_id == 2 and "no_such_method" in sent[1].error


def test_a_failing_step_is_reported_once_and_ends_the_loop():
    core = StandInCore()
    core.step = lambda: 1 / 0
    loop = _loop(core)
    inbox: queue.Queue = queue.Queue()
    inbox.put(AddRequest(_request("a"), 0))
    loop.run(inbox)  # returns: no Shutdown needed
    [failed] = _control_messages(loop)
    assert failed.rank == 0 and "ZeroDivisionError" in failed.message


def test_a_failure_while_a_stop_is_queued_is_a_quiet_stop():
    core = StandInCore()
    inbox: queue.Queue = queue.Queue()

    def step():  # told to stop while in a collective with a peer that stopped first
        inbox.put(Shutdown())
        raise RuntimeError("Connection closed by peer")

    core.step = step
    loop = _loop(core)
    inbox.put(AddRequest(_request("a"), 0))
    loop.run(inbox)
    assert _control_messages(loop) == []


def test_figures_go_out_when_they_change_and_an_idle_core_sends_nothing():
    core = StandInCore(steps=1)
    loop = _loop(core)
    inbox: queue.Queue = queue.Queue()
    loop._publish([])  # the first copy, as run() sends it
    assert loop.sent[-1].figures.running == 0
    loop._publish([])
    loop._step()
    assert len(loop.sent) == 1  # nothing changed, nothing ran
    inbox.put(AddRequest(_request("a"), 0))
    loop._drain(inbox)
    loop._publish([])  # an input alone changed them (as an abort freeing blocks would)
    assert len(loop.sent) == 2 and loop.sent[-1].figures.data_parallel[0].requests == 1 and not loop.sent[-1].outputs
