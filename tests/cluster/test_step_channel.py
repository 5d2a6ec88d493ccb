"""Per-step messages (cluster.replica.step_channel) over a real in-process engine, no Ray: what the
front end rebuilds from the deltas equals the offline engine's outputs, one message carries a
whole step of several requests, message size does not grow with the prompt, and a front
end that goes away leaves nothing running."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from cluster.replica.step_channel import StepHub
from engine import LLM, AsyncLLM, EngineArgs, SamplingParams
from engine.outputs import DeltaAccumulator
from tests.cluster.helpers import until
from tests.engine.hf_reference import random_prompts

ENGINE = {"max_model_len": 512, "num_kv_blocks": 128}


@pytest.fixture(scope="module")
def engine(tiny_model):
    llm = AsyncLLM.from_engine_args(EngineArgs(tiny_model, **ENGINE))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLM(tiny_model, **ENGINE)


async def _through_hub(engine, prompts, params, interval_s=0.0):
    hub = StepHub(interval_s, linger_s=0.2)
    accs, finals, messages = {}, {}, []
    for i, ids in enumerate(prompts):
        rid = f"r{i}-{interval_s}-{len(ids)}"
        accs[rid] = DeltaAccumulator(rid, None, ids, params.logprobs is not None)
        await engine.submit(engine.process({"prompt_token_ids": ids}, params, rid), hub.sink("ingress-a", rid))
    async for batch in hub.subscribe("ingress-a", engine.abort):
        messages.append(batch)
        for d in batch:
            finals[d.request_id] = accs[d.request_id].add(d)
    assert not hub.channels  # closed once idle, and forgotten
    return messages, [finals[rid] for rid in accs]


def _assert_same(finals, expected):
    for got, want in zip(finals, expected):
        assert got.finished
        g, w = got.outputs[0], want.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (w.token_ids, w.text, w.finish_reason,
                                                                         w.stop_reason)
        # Same tokens; logprob values within float noise (batches may be composed differently).
        assert (g.logprobs is None) == (w.logprobs is None)
        for gp, wp in zip(g.logprobs or [], w.logprobs or []):
            assert gp.keys() == wp.keys()
            assert all(abs(gp[t] - wp[t]) < 1e-4 for t in gp)
        assert len(g.logprobs or []) == len(w.logprobs or [])


def test_deltas_rebuild_the_offline_outputs_and_one_message_carries_a_step(engine, offline):
    prompts = random_prompts([20, 33, 47, 12], 1000, seed=3)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    expected = offline.generate([{"prompt_token_ids": p} for p in prompts], params)
    messages, finals = asyncio.run(_through_hub(engine, prompts, params))
    _assert_same(finals, expected)
    # Once all four run, a step's message holds a delta of each; there are no more messages
    # than steps (10 per request, plus at most one each for the requests that joined late
    # while the first ones ran), not one per token.
    assert max(len(b) for b in messages) == 4
    assert len(messages) <= 10 + 3 < sum(len(b) for b in messages)


def test_stop_strings_and_seeded_sampling_survive_the_deltas(engine, offline):
    prompts = random_prompts([25, 18], 1000, seed=5)
    plain = offline.generate([{"prompt_token_ids": p} for p in prompts],
                             SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    # A stop string taken from the middle of what the model says, so it is really hit.
    text = plain[0].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip()
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=12, stop=[stop], ignore_eos=True)
    expected = offline.generate([{"prompt_token_ids": p} for p in prompts], params)
    _, finals = asyncio.run(_through_hub(engine, prompts, params))
    _assert_same(finals, expected)


def test_characters_split_over_tokens_arrive_whole_and_join_to_the_offline_text(engine, offline, tiny_model):
    """A choice whose characters each span several byte-level tokens (forced with a grammar):
    no delta carries half a character, and the deltas join to exactly the offline text."""
    from engine import StructuredOutputsParams

    choice = "日本語 über naïve"
    tokenizer = offline.get_tokenizer()
    assert any("\ufffd" in tokenizer.decode([t]) for t in tokenizer.encode(choice, add_special_tokens=False))
    params = SamplingParams(temperature=0, max_tokens=32, structured_outputs=StructuredOutputsParams(choice=[choice]))
    prompts = random_prompts([14], 1000, seed=8)
    expected = offline.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert expected[0].outputs[0].text == choice
    messages, finals = asyncio.run(_through_hub(engine, prompts, params))
    _assert_same(finals, expected)
    pieces = [d.text for b in messages for d in b if d.text]
    assert "".join(pieces) == choice and len(pieces) > 1
    assert not any("\ufffd" in p for p in pieces)


def test_stream_interval_coalesces_steps_into_fewer_messages(engine, offline):
    prompts = random_prompts([16, 16], 1000, seed=7)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = offline.generate([{"prompt_token_ids": p} for p in prompts], params)
    every_step, finals = asyncio.run(_through_hub(engine, prompts, params, 0.0))
    _assert_same(finals, expected)
    coalesced, finals = asyncio.run(_through_hub(engine, prompts, params, 0.5))
    _assert_same(finals, expected)
    assert len(coalesced) < len(every_step)
    assert any(len(d.token_ids) > 1 for b in coalesced for d in b)


def test_first_and_last_deltas_are_not_held_by_the_interval(engine, offline):
    """With an interval far longer than the run, each request's first delta (its first token)
    and its last (the finish) still go out at once; only the deltas between wait, so each
    request arrives in two pieces. Held like the others, the run would take minutes: the
    bound below is a fraction of the interval."""
    prompts = random_prompts([21, 17], 1000, seed=12)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (9, 23)]
    expected = [offline.generate([{"prompt_token_ids": p}], sp)[0] for p, sp in zip(prompts, params)]

    async def main():
        hub = StepHub(600.0, linger_s=0.2)
        accs, finals, messages = {}, {}, []
        for i, (ids, sp) in enumerate(zip(prompts, params)):
            rid = f"urgent-{i}"
            accs[rid] = DeltaAccumulator(rid, None, ids, False)
            await engine.submit(engine.process({"prompt_token_ids": ids}, sp, rid), hub.sink("ingress-u", rid))

        async def consume():
            async for batch in hub.subscribe("ingress-u", engine.abort):
                messages.append(batch)
                for d in batch:
                    finals[d.request_id] = accs[d.request_id].add(d)
        await asyncio.wait_for(consume(), 60)
        return messages, [finals[rid] for rid in accs]

    messages, finals = asyncio.run(main())
    _assert_same(finals, expected)
    for i in range(2):
        mine = [d for b in messages for d in b if d.request_id == f"urgent-{i}"]
        # Sent at once, not finished: the first token (with the next ones when the event loop
        # ran late and later steps merged into it before the send, as on a loaded machine).
        assert mine[0].token_ids and not mine[0].finished
        # Then the rest in one piece, held until the finish, even while the other request's
        # first or last delta went out (those go alone, not with everything pending).
        assert len(mine) == 2 and mine[1].finished
    assert len(messages) <= 4


def test_message_size_does_not_grow_with_the_prompt(engine):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    sizes = {}
    for n in (16, 400):
        messages, _ = asyncio.run(_through_hub(engine, random_prompts([n], 1000, seed=n), params))
        sizes[n] = [len(pickle.dumps(b)) for b in messages]
    # 400 prompt ids would take over 800 bytes pickled; no message comes near that.
    assert max(sizes[400]) < 600
    assert max(sizes[400]) <= max(sizes[16]) + 32


def test_a_front_end_that_goes_away_leaves_nothing_running(engine):
    async def main():
        hub = StepHub(0.0, linger_s=0.2)
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        for i, ids in enumerate(random_prompts([30, 40], 1000, seed=9)):
            await engine.submit(engine.process({"prompt_token_ids": ids}, params, f"gone-{i}"),
                                hub.sink("ingress-b", f"gone-{i}"))
        stream = hub.subscribe("ingress-b", engine.abort)
        assert await stream.__anext__()
        await stream.aclose()  # the ingress is gone
        for _ in range(500):  # the aborts run on the engine thread: wait for them, bounded
            load = await engine.load()
            if load.running == 0 and load.waiting == 0 and load.free_blocks == load.total_blocks:
                break
            await asyncio.sleep(0.01)
        assert load.running == 0 and load.waiting == 0, load
        assert load.free_blocks == load.total_blocks, load
        assert not hub.channels and not hub.owner

    asyncio.run(main())


def test_an_engine_failure_ends_a_held_subscription_at_once():
    """The engine's error cuts the interval short too: the subscription raises EngineFailed
    instead of holding it (and the ingress's requests) for the rest of a 600 s interval."""
    from cluster.replica.step_channel import EngineFailed
    from engine.outputs import CompletionOutput, RequestOutput

    def out(tokens: list[int]) -> RequestOutput:
        return RequestOutput(request_id="f", prompt=None, prompt_token_ids=[5, 6],
                             outputs=[CompletionOutput(0, "", tokens)], finished=False,
                             delta_token_ids=tokens[-1:])

    async def main():
        hub = StepHub(600.0, linger_s=0.2)
        put = hub.sink("ingress-f", "f")
        stream = hub.subscribe("ingress-f", lambda rid: asyncio.sleep(0))
        put(out([1]))
        first = await asyncio.wait_for(stream.__anext__(), 30)  # the first token: not held
        put(out([1, 2]))  # held for the interval
        nxt = asyncio.ensure_future(stream.__anext__())
        await until(lambda: hub.channels["ingress-f"]._urgent_waiter is not None, "the subscription to hold")
        put(RuntimeError("boom"))
        with pytest.raises(EngineFailed, match="boom"):
            await asyncio.wait_for(nxt, 30)
        return first

    first = asyncio.run(main())
    assert [d.token_ids for d in first] == [[1]]


def test_a_pooling_requests_vector_crosses_the_deltas(tiny_model):
    from engine.pooling import PoolingParams

    pooling = AsyncLLM.from_engine_args(EngineArgs(tiny_model, runner="pooling", **ENGINE))
    prompts = random_prompts([3, 70], 1000, seed=61)
    expected = LLM(tiny_model, runner="pooling", **ENGINE).embed([{"prompt_token_ids": p} for p in prompts],
                                                                  use_tqdm=False)

    async def main():
        hub, accs, finals = StepHub(0.0, linger_s=0.2), {}, {}
        for i, ids in enumerate(prompts):
            accs[f"p{i}"] = DeltaAccumulator(f"p{i}", None, ids, False)
            request = pooling.process({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), f"p{i}",
                                      pooling_params=PoolingParams())
            await pooling.submit(request, hub.sink("ingress-a", f"p{i}"))
        async for batch in hub.subscribe("ingress-a", pooling.abort):
            for d in pickle.loads(pickle.dumps(batch)):  # as the channel carries them
                finals[d.request_id] = accs[d.request_id].add(d)
        return [finals[f"p{i}"] for i in range(len(prompts))]

    try:
        for got, want in zip(asyncio.run(main()), expected):
            assert got.finished and got.pooled.tolist() == pytest.approx(want.outputs.embedding, abs=1e-6)
    finally:
        pooling.shutdown()
