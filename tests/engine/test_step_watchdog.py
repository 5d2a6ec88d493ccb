"""The engine hang watchdog (engine.core_client.watchdog): a process that is alive but silent,
stopped with SIGSTOP, fails the engine within engine_step_timeout_s. An engine core process
(engine_core_process) and a tensor-parallel rank (the "mp" executor) are stopped mid-request:
the request ends with an error within the bound, never hangs, and the health check fails. An
idle core that keeps answering stays healthy past the bound (its heartbeats). Every stopped
process is continued and the engine shut down at the end; no process is left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from engine import AsyncLLM, EngineArgs, SamplingParams
from engine.errors import EngineDeadError, ParameterError
from tests.cluster.helpers import proc_stat, running, wait_for

BOUND_S = 2.0
# What the watchdog may add to the bound: its thread looks every bound/4, the engine thread
# every 0.1 s; the rest is a loaded 2-core machine's scheduling.
SLACK_S = 8.0
ENGINE = dict(max_model_len=256, max_num_seqs=4, engine_step_timeout_s=BOUND_S)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


def _engine(model: str, **kwargs) -> AsyncLLM:
    return AsyncLLM(EngineArgs(model=model, **ENGINE, **kwargs).create_engine_config("serving"))


async def _stop_mid_request(engine: AsyncLLM, pid: int) -> float:
    """Start a long request, SIGSTOP `pid` once it streams, and return how long after the stop
    the request ended with an error (bounded: a hang fails the test)."""
    stream = engine.generate(engine.process({"prompt_token_ids": list(range(10, 40))}, LONG, "long"))
    await stream.__anext__()  # it runs
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    with pytest.raises(RuntimeError, match="engine failed: .*engine_step_timeout_s=2"):
        await asyncio.wait_for(_drain(stream), BOUND_S + SLACK_S)
    return time.monotonic() - stopped


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def _continue_and_shut_down(engine: AsyncLLM, pids: list[int]) -> None:
    starts = {pid: (proc_stat(pid) or [None] * 20)[19] for pid in pids}
    for pid in pids:
        if running(pid, starts[pid]):
            os.kill(pid, signal.SIGCONT)
    engine.shutdown()
    for pid in pids:
        wait_for(lambda pid=pid: not running(pid, starts[pid]), f"process {pid} to be gone", 30, 0.1)


def test_a_stopped_core_process_fails_its_request_and_the_health_check_but_an_idle_one_does_not(model_factory):
    engine = _engine(model_factory("llama"), engine_core_process=True)
    [core] = engine.engine.core.core_pids()
    try:
        # Idle for twice the bound: its heartbeats keep it healthy.
        deadline = time.monotonic() + 2 * BOUND_S
        while time.monotonic() < deadline:
            asyncio.run(engine.check_health())
            time.sleep(0.1)  # sampling the health check over a window, not waiting for an event
        took = asyncio.run(_stop_mid_request(engine, core))
        assert BOUND_S <= took <= BOUND_S + SLACK_S
        with pytest.raises(RuntimeError, match="silent for .* s, over engine_step_timeout_s=2"):
            asyncio.run(engine.check_health())
    finally:
        _continue_and_shut_down(engine, [core])


def test_an_idle_stopped_core_process_fails_the_health_check_and_the_next_request_at_once(model_factory):
    engine = _engine(model_factory("llama"), engine_core_process=True)
    [core] = engine.engine.core.core_pids()
    try:
        os.kill(core, signal.SIGSTOP)

        def unhealthy() -> bool:
            try:
                asyncio.run(engine.check_health())
            except EngineDeadError:
                return True
            return False
        wait_for(unhealthy, "the health check to fail", BOUND_S + SLACK_S)

        async def one():
            await _drain(engine.generate(engine.process({"prompt_token_ids": [5, 6, 7]}, LONG, "next")))
        with pytest.raises(EngineDeadError, match="silent"):
            asyncio.run(asyncio.wait_for(one(), 10))
    finally:
        _continue_and_shut_down(engine, [core])


def test_a_stopped_tensor_parallel_rank_fails_the_step_it_hangs_and_the_health_check(model_factory):
    engine = _engine(model_factory("llama"), tensor_parallel_size=2, distributed_executor_backend="mp")
    ranks = engine.engine.core.executor.pids
    try:
        took = asyncio.run(_stop_mid_request(engine, ranks[1]))
        assert BOUND_S <= took <= BOUND_S + SLACK_S
        with pytest.raises(RuntimeError, match="an engine step has run for"):
            asyncio.run(engine.check_health())
    finally:
        started = time.monotonic()
        _continue_and_shut_down(engine, ranks)
        # The engine thread is still in the hung step: shutdown does not wait on it, it ends it.
        assert time.monotonic() - started < 25


@pytest.mark.parametrize("bound", [1.0, -1, True, "60"])
def test_a_bound_under_the_heartbeat_margin_or_not_a_number_is_refused(tiny_model, bound):
    with pytest.raises(ParameterError, match=r"engine_step_timeout_s must be 0 \(no bound\) or in \[2, 86400\]"):
        EngineArgs(model=tiny_model, engine_step_timeout_s=bound).create_engine_config()
