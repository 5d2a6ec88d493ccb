"""EngineFeeder (the batch actor's engine, fed from several batches at once): rows handed over
by concurrent callers come back exactly as the offline engine generates them (greedy), in each
caller's order; rows of several callers share the engine; a bad row fails alone; an engine
that fails fails every waiting row and every later call, within a bound (nothing hangs)."""

from __future__ import annotations

import dataclasses

import pytest

from engine import LLM, SamplingParams
from tests.cluster.helpers import engine_request, in_thread

ENGINE = {"max_model_len": 128, "num_kv_blocks": 96}
WORDS = "river engineer village quietly measures before once upon time small sea help there".split()
WAIT_S = 120


def _prompts(n: int) -> list[str]:
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + (i * 5) % 9)) for i in range(n)]


@pytest.mark.timeout(300)
def test_concurrent_callers_get_the_offline_engines_outputs_in_order(tiny_model):
    from cluster.batch.feeder import EngineFeeder

    prompts = _prompts(48)
    params = [SamplingParams(max_tokens=16 + i % 7, temperature=0.0) for i in range(48)]
    ref = LLM(tiny_model, **ENGINE).generate(prompts, params, use_tqdm=False)

    engine = LLM(tiny_model, **ENGINE).engine
    feeder = EngineFeeder(engine)
    requests = [engine.process(p, sp, feeder.next_id()) for p, sp in zip(prompts, params)]
    slices = [range(k, k + 12) for k in range(0, 48, 12)]
    # Every caller's rows are handed over before any is awaited, as Ray Data's async batches are.
    futures = [feeder.submit([requests[i] for i in s]) for s in slices]

    def wait(k: int) -> list:
        return [f.result(timeout=WAIT_S) for f in futures[k]]

    # Each caller waits in its own thread; a caller's error (a failed row, a timeout) is raised here.
    waiting = [in_thread(wait, k) for k in range(len(slices))]
    got = [out for w in waiting for out in w.result(timeout=2 * WAIT_S)]
    for o, r in zip(got, ref):
        assert o.prompt_token_ids == r.prompt_token_ids  # row order kept
        assert list(o.outputs[0].token_ids) == list(r.outputs[0].token_ids)
        assert o.outputs[0].text == r.outputs[0].text
        assert o.outputs[0].finish_reason == r.outputs[0].finish_reason
    assert feeder.peak_in_flight > 12  # rows of several callers were in the engine at once
    feeder.close(timeout=WAIT_S)
    assert not feeder._thread.is_alive()


@pytest.mark.timeout(300)
def test_a_row_over_the_engines_limits_fails_alone(tiny_model):
    from cluster.batch.feeder import EngineFeeder

    engine = LLM(tiny_model, **ENGINE).engine
    feeder = EngineFeeder(engine)
    good = engine.process("once upon", SamplingParams(max_tokens=4), feeder.next_id())
    # Built for a longer context than this engine's: its check refuses it, the others go on.
    over = dataclasses.replace(engine.process("small sea", SamplingParams(max_tokens=4), feeder.next_id()),
                               prompt_token_ids=[5] * 400)
    good_f, over_f = feeder.submit([good, over])
    assert good_f.result(timeout=WAIT_S).outputs[0].finish_reason in ("length", "stop")
    with pytest.raises(ValueError, match="max_model_len"):
        over_f.result(timeout=WAIT_S)
    last = engine.process("small sea", SamplingParams(max_tokens=3, ignore_eos=True), feeder.next_id())
    assert len(feeder.generate([last])[0].outputs[0].token_ids) == 3
    feeder.close(timeout=WAIT_S)


class _FailingEngine:
    """Accepts requests; its third step raises."""

    def __init__(self) -> None:
        self.steps = 0

    def add(self, request):
        return request.request_id

    def step(self):
        self.steps += 1
        if self.steps == 3:
            raise RuntimeError("device lost")
        return []


@pytest.mark.timeout(60)
def test_a_failing_engine_fails_every_waiting_row_and_later_calls():
    from cluster.batch.feeder import EngineFeeder

    feeder = EngineFeeder(_FailingEngine())
    futures = feeder.submit([engine_request(r) for r in "abc"])
    for f in futures:
        with pytest.raises(RuntimeError, match="device lost"):
            f.result(timeout=30)
    with pytest.raises(RuntimeError, match="device lost"):
        feeder.submit([engine_request("d")])
    feeder.close(timeout=30)
    assert not feeder._thread.is_alive()
