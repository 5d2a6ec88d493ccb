"""The asyncio streaming front: deltas add up to the offline result, concurrent streams
are independent, and leaving a stream early aborts it and frees its KV blocks."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, AsyncLLM, EngineArgs, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The river ran", "Hello! How can I", "Stars are born", "To make bread"]


@pytest.fixture(scope="module")
def offline(tiny_model):
    outs = LLM(tiny_model, max_model_len=128).generate(PROMPTS, PARAMS, use_tqdm=False)
    return {p: o.outputs[0] for p, o in zip(PROMPTS, outs)}


@pytest.fixture
def engine(tiny_model):
    eng = AsyncLLM.from_engine_args(EngineArgs(tiny_model, max_model_len=128))
    yield eng
    eng.shutdown()


async def _collect(engine, prompt, params=PARAMS):
    text, ids, last = "", [], None
    async for out in engine.generate(engine.process(prompt, params)):
        text += out.delta_text
        ids += out.delta_token_ids
        last = out
    return text, ids, last


def test_stream_deltas_add_up_to_offline_output(engine, offline):
    text, ids, last = asyncio.run(_collect(engine, PROMPTS[0]))
    assert ids == offline[PROMPTS[0]].token_ids == last.outputs[0].token_ids
    assert text == offline[PROMPTS[0]].text
    assert last.finished and last.outputs[0].finish_reason == "length"


def test_concurrent_streams_match_offline(engine, offline):
    async def main():
        return await asyncio.gather(*(_collect(engine, p) for p in PROMPTS))

    results = asyncio.run(main())
    for p, (text, ids, _) in zip(PROMPTS, results):
        assert ids == offline[p].token_ids and text == offline[p].text


def test_leaving_a_stream_early_aborts_and_frees_blocks(engine):
    core = engine.engine.core

    async def main():
        stream = engine.generate(engine.process("The river ran", SamplingParams(max_tokens=100, ignore_eos=True)))
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await stream.aclose()

    asyncio.run(main())
    assert not core.has_unfinished_requests()
    assert core.kv_cache_manager.get_num_free_blocks() == core.num_kv_blocks


def test_invalid_request_raises_to_the_caller(engine):
    async def main():
        async for _ in engine.generate(engine.process("x", SamplingParams(max_tokens=10_000))):
            pass

    with pytest.raises(ValueError, match="max_tokens"):
        asyncio.run(main())
    assert not engine.engine.core.has_unfinished_requests()


def test_streamed_text_never_leaks_a_stop_string(engine, offline):
    full = offline[PROMPTS[1]].text
    stop = full[4:7]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    text, _, last = asyncio.run(_collect(engine, PROMPTS[1], params))
    assert text == last.outputs[0].text == full[: full.index(stop)]


def _stream_then(engine, after_two) -> list:
    """Stream request "x" and await `after_two()` once it has two outputs (aborting it from
    outside); the outputs the stream gave, bounded by 60 s."""
    outs = []

    async def consume():
        async for out in engine.generate(engine.process("The river ran", SamplingParams(max_tokens=100, ignore_eos=True),
                                                        request_id="x")):
            outs.append(out)
            if len(outs) == 2:
                await after_two()

    asyncio.run(asyncio.wait_for(consume(), timeout=60))
    return outs


def test_abort_from_outside_ends_the_stream(engine):
    core = engine.engine.core
    outs = _stream_then(engine, lambda: engine.abort("x"))
    assert len(outs) >= 2 and not outs[-1].finished
    assert not core.has_unfinished_requests()
    assert core.kv_cache_manager.get_num_free_blocks() == core.num_kv_blocks


def test_a_call_queued_while_the_engine_step_fails_is_failed_not_left_waiting():
    import threading
    from types import SimpleNamespace

    in_step, fail_now = threading.Event(), threading.Event()

    class FailingEngine:
        core = SimpleNamespace(set_kv_wakeup=lambda cb: None, idle=False, wake=lambda: None)

        def has_work(self):
            return True

        def step(self):
            in_step.set()
            fail_now.wait(60)
            raise RuntimeError("tensor-parallel rank 1 died")

    eng = AsyncLLM(engine=FailingEngine())
    assert in_step.wait(60)
    queued = eng.call(lambda: "never runs")  # arrives while the failing step runs
    fail_now.set()
    with pytest.raises(RuntimeError, match="engine is dead: .*rank 1 died"):
        queued.result(timeout=60)
    with pytest.raises(RuntimeError, match="engine is dead"):  # and every later call at once
        eng.call(lambda: None).result(timeout=0)


def _gate(engine):
    """Hold the engine thread in a call until the returned event is set: calls made
    meanwhile wait in its queue, as they do behind a long step."""
    import threading

    entered, release = threading.Event(), threading.Event()

    def hold():
        entered.set()
        release.wait(60)

    engine.call(hold)
    assert entered.wait(60)
    return release


async def _until_queued(engine, fn, timeout_s: float = 60) -> None:
    """Wait (polled, bounded) until a call of `fn` waits in the engine thread's queue."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s

    def queued() -> bool:
        with engine._inputs.mutex:
            return any(isinstance(item, tuple) and item[0] == fn for item in engine._inputs.queue)

    while not queued():
        assert loop.time() < deadline, f"{fn} was never queued"
        await asyncio.sleep(0.001)


def test_a_cancelled_abort_still_aborts_and_the_engine_thread_lives(engine, offline):
    """Serve cancels a call whose caller left (`CALL abort CANCELLED`). That cancellation once
    reached the engine thread's future, which then raised InvalidStateError and killed the
    thread: every later request hung."""
    core = engine.engine.core

    async def cancelled_abort():
        release = _gate(engine)
        abort = asyncio.ensure_future(engine.abort("x"))
        await _until_queued(engine, engine.engine.abort_request)  # behind the gate
        abort.cancel()  # its caller goes away first
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(abort, 60)

    outs = _stream_then(engine, cancelled_abort)
    assert not outs[-1].finished
    assert engine._thread.is_alive()
    text, ids, _ = asyncio.run(asyncio.wait_for(_collect(engine, PROMPTS[0]), 60))  # still serving, exactly
    assert ids == offline[PROMPTS[0]].token_ids and text == offline[PROMPTS[0]].text
    assert not core.has_unfinished_requests()
    assert core.kv_cache_manager.get_num_free_blocks() == core.num_kv_blocks


def test_a_request_whose_submit_was_cancelled_is_never_added(engine, offline):
    core = engine.engine.core
    seen = []

    async def main():
        release = _gate(engine)
        submit = asyncio.ensure_future(engine.submit(engine.process("The river ran", PARAMS, "gone"), seen.append))
        await _until_queued(engine, engine.engine.add)  # behind the gate
        submit.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(submit, 60)
        return await asyncio.wait_for(_collect(engine, PROMPTS[0]), 60)  # the thread went on

    text, ids, _ = asyncio.run(main())
    assert ids == offline[PROMPTS[0]].token_ids and text == offline[PROMPTS[0]].text
    assert seen == [] and "gone" not in engine._streams
    assert not core.has_unfinished_requests()
    assert core.kv_cache_manager.get_num_free_blocks() == core.num_kv_blocks


def test_a_loop_running_behind_the_engine_still_gets_every_output_once(engine, offline):
    """The event loop may run several steps behind the engine thread (a busy replica). Here
    it is held inside the first output's callback until the engine has finished the request:
    every hand-over queued meanwhile, the last one with the finish, must still be delivered
    in order, none dropped because the request already left the engine."""
    core = engine.engine.core

    async def main():
        got, done = [], asyncio.Event()

        def sink(out):
            got.append(out)
            if len(got) == 1:  # block this loop until the engine is done with the request
                while engine.call(core.has_unfinished_requests).result(timeout=60):
                    pass  # each call is answered between two steps: no sleeping
            if out.finished:
                done.set()

        await engine.submit(engine.process(PROMPTS[0], PARAMS, "a"), sink)
        await asyncio.wait_for(done.wait(), 60)
        return got

    got = asyncio.run(asyncio.wait_for(main(), 120))
    assert [i for out in got for i in out.delta_token_ids] == offline[PROMPTS[0]].token_ids
    assert [out.finished for out in got] == [False] * (len(got) - 1) + [True]


def test_outputs_that_queue_while_the_caller_is_busy_come_out_as_one(engine, offline):
    """A caller that fell behind (it awaited something else while the engine stepped) gets one
    output with every missed step's deltas, not one per step: what keeps a slow HTTP client
    from costing one SSE chunk per engine step."""

    async def main():
        stream = engine.generate(engine.process(PROMPTS[0], PARAMS))
        first = await stream.__anext__()
        # Busy elsewhere until the engine finished the request: its outputs queue meanwhile.
        for _ in range(1000):  # bounded: the request has 11 more steps to run
            if not await asyncio.wrap_future(engine.call(engine.engine.has_unfinished_requests)):
                break
        rest = [out async for out in stream]
        return first, rest

    first, rest = asyncio.run(main())
    want = offline[PROMPTS[0]]
    assert len(rest) == 1 and rest[0].finished  # every queued step in one output
    assert first.delta_token_ids + rest[0].delta_token_ids == want.token_ids == rest[0].outputs[0].token_ids
    assert first.delta_text + rest[0].delta_text == want.text


def test_a_stream_interval_gathers_the_steps_after_the_first_output_until_the_last(engine, offline):
    """With an interval longer than the whole request, the caller gets the first token at once
    and everything else in one final output: the interval holds outputs back, but never the
    first one, and the request's end cuts the hold short (no wait for the interval's end)."""

    async def main():
        return [out async for out in engine.generate(engine.process(PROMPTS[1], PARAMS), stream_interval_s=30.0)]

    outs = asyncio.run(main())
    want = offline[PROMPTS[1]]
    assert [len(o.delta_token_ids) for o in outs] == [1, len(want.token_ids) - 1] and outs[-1].finished
    assert "".join(o.delta_text for o in outs) == want.text and outs[-1].outputs[0].token_ids == want.token_ids
