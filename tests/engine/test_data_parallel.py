"""Data parallelism offline: engine cores in processes ("mp" backend) behind one front end,
with expert parallelism (lockstep waves, dummy batches) and without. The oracle is Hugging
Face `generate`; the cores' own figures say who ran what."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from engine import LLM, AsyncLLM, EngineArgs, SamplingParams
from engine.errors import EngineDeadError, ParameterError
from tests.engine.hf_reference import hf_greedy, random_prompts

MAX_NEW = 12
# Prompts over 16 tokens are chunked; prefix caching stays on.
ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, long_prefill_token_threshold=16)


def _greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


def _cores(llm: LLM) -> list[dict]:
    return llm.engine.core.load().data_parallel


@pytest.fixture(scope="module")
def moe_model(model_factory) -> str:
    return model_factory("qwen3_moe")


@pytest.fixture(scope="module")
def ep_llm(moe_model):
    """Two cores, experts split over them (lockstep)."""
    llm = LLM(moe_model, data_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    yield llm
    llm.shutdown()


def test_expert_parallel_over_two_cores_equals_transformers_and_uses_both(ep_llm, moe_model):
    prompts = random_prompts([3, 21, 40, 9, 30, 17], 900, seed=11)
    prompts.append(prompts[2][:33] + [5, 6])  # shares two blocks with an earlier prompt
    before = [c.requests for c in _cores(ep_llm)]
    outs = ep_llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(moe_model, prompts, MAX_NEW)
    served = [c.requests - b for c, b in zip(_cores(ep_llm), before)]
    assert sum(served) == len(prompts) and min(served) >= 2, served
    figures = ep_llm.engine.core.load()
    assert figures.free_blocks == figures.total_blocks  # every core freed every block


def test_a_lone_request_finishes_while_the_idle_core_steps_on_no_tokens(ep_llm, moe_model):
    before = _cores(ep_llm)
    [prompt] = random_prompts([13], 900, seed=12)
    [out] = ep_llm.generate([{"prompt_token_ids": prompt}], _greedy(), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(moe_model, [prompt], MAX_NEW)[0]
    after = _cores(ep_llm)
    [busy] = [r for r in range(2) if after[r].requests > before[r].requests]
    idle = 1 - busy
    # One step per token at least, each a collective the idle core joined on no tokens.
    assert after[idle].dummy_steps - before[idle].dummy_steps >= MAX_NEW
    metrics = {(m.name, m.labels.get("engine")): m for m in ep_llm.get_metrics()}
    # The wave may still run (its end is found every 32 steps), so the count may have grown.
    assert metrics[("pdserve:dp_dummy_batches", str(idle))].value >= after[idle].dummy_steps
    assert metrics[("pdserve:dp_engine_requests", str(busy))].value == after[busy].requests


def test_aborting_on_one_core_leaves_the_other_running_and_frees_its_blocks(ep_llm, moe_model):
    engine = ep_llm.engine
    prompts = random_prompts([11, 14], 900, seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": p}, params)
    owners = {rid: engine.core._owners[rid][0] for rid in ("abort-0", "abort-1")}
    assert sorted(owners.values()) == [0, 1]  # one request per core
    tokens: dict[str, list[int]] = {"abort-0": [], "abort-1": []}
    deadline = time.monotonic() + 120
    while min(len(t) for t in tokens.values()) < 3:
        assert time.monotonic() < deadline
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    engine.abort_request("abort-0")
    finished = None
    while finished is None:
        assert time.monotonic() < deadline
        for out in engine.step():
            assert out.request_id == "abort-1", "nothing comes back for an aborted request"
            if out.finished:
                finished = out
    expected = hf_greedy(moe_model, [prompts[1]], 40)[0]
    assert list(finished.outputs[0].token_ids) == expected[: len(finished.outputs[0].token_ids)]
    assert len(finished.outputs[0].token_ids) == 40
    figures = engine.core.load()
    assert figures.free_blocks == figures.total_blocks and figures.running == 0


def test_sizes_are_checked_before_any_core_starts(model_factory, moe_model):
    dense = model_factory("llama")
    with pytest.raises(ParameterError, match="needs a mixture-of-experts model") as e:
        LLM(dense, data_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    assert e.value.field == "enable_expert_parallel"
    with pytest.raises(ParameterError, match=r"= 3 ranks") as e:  # 8 experts do not split over 3
        LLM(moe_model, data_parallel_size=3, enable_expert_parallel=True, **ENGINE)
    assert e.value.field == "enable_expert_parallel"
    for field, value in (("data_parallel_size", 0), ("data_parallel_backend", "threads")):
        with pytest.raises(ParameterError) as e:
            EngineArgs(model=dense, **{field: value}).create_engine_config()
        assert e.value.field == field


def test_independent_cores_stream_through_async_llm_like_transformers(model_factory):
    """Without expert parallelism the cores never wait for each other (no dummy batches)."""
    model = model_factory("llama")
    prompts = random_prompts([5, 19, 8, 27], 120, seed=14)
    engine = AsyncLLM(EngineArgs(model=model, data_parallel_size=2, **ENGINE).create_engine_config())

    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(engine.process({"prompt_token_ids": prompt}, _greedy(), f"s{i}")):
            tokens.extend(out.outputs[0].token_ids[len(tokens):])
        return tokens

    async def all_of_them():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        assert asyncio.run(all_of_them()) == hf_greedy(model, prompts, MAX_NEW)
        cores = engine.engine.core.load().data_parallel
        assert [c.requests for c in cores] == [2, 2] and [c.dummy_steps for c in cores] == [0, 0]
    finally:
        engine.shutdown()


def test_a_killed_core_fails_the_group_fast_and_takes_its_peer_down(moe_model):
    llm = LLM(moe_model, data_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    engine = llm.engine
    try:
        params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        for i, p in enumerate(random_prompts([6, 9], 900, seed=15)):
            engine.add_request(f"k{i}", {"prompt_token_ids": p}, params)
        while not engine.step():
            pass  # until the cores are decoding (the survivor then waits in a collective)
        procs = [p.proc for p in engine.core.cores.processes]
        os.kill(procs[1].pid, signal.SIGKILL)
        start = time.monotonic()
        # Seen through the dead core's closed pipe (its exit code), not a collective timeout.
        with pytest.raises(EngineDeadError, match=r"data-parallel core 1 \(pid \d+\) exited with code -9"):
            while time.monotonic() - start < 120:  # a bound on the test, far below the 300 s collective timeout
                engine.step()
        assert not any(p.is_alive() for p in procs)  # the survivor was stopped, not left in its collective
        with pytest.raises(EngineDeadError):
            engine.add_request("after", {"prompt_token_ids": [5, 6]}, params)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_dummy_batch_runs_every_moe_layer_on_no_tokens_and_touches_no_kv(moe_model, backend):
    from engine.core import EngineCore

    core = EngineCore(EngineArgs(model=moe_model, kernel_backend=backend, num_kv_blocks=16,
                                 max_model_len=64).create_engine_config())
    runner = core.executor.worker.runner
    seen: list[int] = []
    hooks = [layer.mlp.register_forward_hook(lambda m, args, out: seen.append(out.shape[0]))
             for layer in runner.model.layers]
    try:
        for k, v in runner.kv_caches:
            k.fill_(1.0)
            v.fill_(1.0)
        core.executor.execute_dummy_batch()
        assert seen == [0] * len(runner.model.layers)  # each MoE layer ran, on zero rows
        assert all(bool((k == 1.0).all() and (v == 1.0).all()) for k, v in runner.kv_caches)
        assert core.kv_cache_manager.get_num_free_blocks() == core.num_kv_blocks
    finally:
        for hook in hooks:
            hook.remove()
        core.shutdown()


@pytest.mark.parametrize("kv_events", [True, False])
def test_kv_aware_routing_sends_each_turn_to_the_core_that_holds_its_history(model_factory, kv_events):
    """Three sessions, two turns each, one request at a time. With KV events a second turn
    goes to the core whose cache holds its first (all of its 48-token history found cached);
    without them load alone decides, and round robin (idle cores tie) splits each session
    from its history."""
    model = model_factory("llama")
    histories = random_prompts([48] * 3, 120, seed=21)
    config = {"enable_kv_cache_events": True} if kv_events else None
    llm = LLM(model, data_parallel_size=2, kv_events_config=config, **ENGINE)
    try:
        firsts = [llm.generate([{"prompt_token_ids": h}], _greedy(4))[0] for h in histories]
        seconds = [h + list(f.outputs[0].token_ids) + [7, 8, 9] for h, f in zip(histories, firsts)]
        outs = [llm.generate([{"prompt_token_ids": p}], _greedy())[0] for p in seconds]
        assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(model, seconds, MAX_NEW)
        cached = [o.num_cached_tokens for o in outs]
        if kv_events:
            assert all(c >= 48 for c in cached), cached
            assert all(c.requests for c in _cores(llm))  # first turns still spread by load
        else:
            assert cached == [0, 0, 0]
    finally:
        llm.shutdown()
