"""engine_core_process: one engine core in a child process of its own (engine.dp's "mp"
backend with one core), as vLLM V1 runs EngineCoreProc. The oracle is Hugging Face greedy;
the child's pid says where the core ran; a killed child is an error at once, never a hang."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from engine import LLM, AsyncLLM, EngineArgs, SamplingParams
from engine.errors import EngineDeadError, ParameterError
from engine.llm_engine import LLMEngine
from tests.cluster.helpers import proc_stat, running
from tests.engine.hf_reference import hf_greedy, random_prompts

MAX_NEW = 10
ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, long_prefill_token_threshold=16)


def _greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


def _gone_within(pid: int, seconds: float) -> bool:
    """`pid` (the process started at the time read now) exits within `seconds`; a zombie left
    unreaped by a container's init counts as gone, a reused pid does not count as alive."""
    first = proc_stat(pid)
    start = first[19] if first else None
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not running(pid, start):
            return True
        time.sleep(0.05)  # polling a pid for its exit: there is nothing to wait on
    return False


def test_the_core_runs_in_a_child_process_streams_like_transformers_and_ends_with_it(model_factory):
    model = model_factory("llama")
    prompts = random_prompts([5, 19, 8, 27], 120, seed=21)
    engine = AsyncLLM(EngineArgs(model=model, engine_core_process=True, **ENGINE).create_engine_config())
    pids = engine.engine.core.core_pids()
    assert len(pids) == 1 and pids[0] != os.getpid()

    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(engine.process({"prompt_token_ids": prompt}, _greedy(), f"p{i}")):
            assert out.outputs[0].token_ids[:len(tokens)] == tokens  # cumulative, as in process
            tokens = list(out.outputs[0].token_ids)
        return tokens

    async def all_of_them():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        assert asyncio.run(all_of_them()) == hf_greedy(model, prompts, MAX_NEW)
        figures = asyncio.run(engine.load())  # on the engine thread, which owns the client
        assert figures.running == figures.waiting == 0 and figures.free_blocks == figures.total_blocks
        assert figures.data_parallel == ()  # one core apart is not data parallelism (no dp_ metrics)
    finally:
        engine.shutdown()
    assert _gone_within(pids[0], 30)


def test_offline_llm_gives_the_in_process_engines_tokens(model_factory):
    model = model_factory("llama")
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 30, 12], 120, seed=22)]
    inproc = LLM(model, **ENGINE)
    apart = LLM(model, engine_core_process=True, **ENGINE)
    try:
        want = [o.outputs[0].token_ids for o in inproc.generate(prompts, _greedy(), use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in apart.generate(prompts, _greedy(), use_tqdm=False)]
        assert got == want
    finally:
        apart.shutdown()
        inproc.shutdown()


def test_a_killed_core_process_fails_the_engine_at_once(model_factory):
    llm = LLM(model_factory("llama"), engine_core_process=True, **ENGINE)
    engine = llm.engine
    try:
        params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        engine.add_request("k", {"prompt_token_ids": [5, 6, 7, 8]}, params)
        deadline = time.monotonic() + 60
        while not engine.step():  # until it decodes
            assert time.monotonic() < deadline, "no output within 60 s"
        os.kill(engine.core.core_pids()[0], signal.SIGKILL)
        start = time.monotonic()
        # Seen through the closed pipe, named as what the user asked for (not a DP core).
        with pytest.raises(EngineDeadError, match=r"the engine core process \(pid \d+\) exited with code -9"):
            while time.monotonic() - start < 60:
                engine.step()
        with pytest.raises(EngineDeadError):
            engine.add_request("after", {"prompt_token_ids": [5, 6]}, params)
    finally:
        llm.shutdown()


def test_a_core_whose_front_end_was_killed_stops_by_itself(model_factory, tmp_path):
    """SIGKILL of the front end (no finalizer runs): the core sees its pipe close and exits,
    so nothing is left behind even outside Ray (which also ends a dead worker's children)."""
    code = (
        "import os, signal, sys\n"
        "from engine import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({model_factory('llama')!r}, engine_core_process=True, max_model_len=128)\n"
        "    print(llm.engine.core.core_pids()[0], flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out, err = tmp_path / "out", tmp_path / "err"
    # Files, not pipes: a core left running would hold a pipe open and stall the wait.
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.run([sys.executable, "-c", code], cwd=root, stdout=o, stderr=e, timeout=300)
    assert proc.returncode == -signal.SIGKILL, err.read_text()[-2000:]
    core = int(out.read_text().split()[0])
    assert _gone_within(core, 30)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(data_parallel_size=2), "data_parallel_size=2"),
    (dict(data_parallel_backend="ray"), "not as a Ray actor"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="ray"), "cannot be Ray actors"),
])
def test_where_a_core_process_cannot_run_is_a_parameter_error(model_factory, kwargs, needle):
    with pytest.raises(ParameterError, match=needle) as e:
        EngineArgs(model=model_factory("llama"), engine_core_process=True, **kwargs).create_engine_config()
    assert e.value.field == "engine_core_process"


def test_a_kv_connector_that_cannot_cross_processes_keeps_the_core_in_process(model_factory):
    # (A relayed connector can: tests/kvstore/test_relay_transport.py.)
    config = EngineArgs(model=model_factory("llama"), engine_core_process=True, **ENGINE).create_engine_config()
    with pytest.raises(ParameterError, match="spawn_safe") as e:
        LLMEngine(config, kv_connector_factory=lambda side: None)
    assert e.value.field == "engine_core_process"
