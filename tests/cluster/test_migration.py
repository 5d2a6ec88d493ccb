"""Decode migration (cluster.http.migration, docs/pd.md#decode-migration): a request whose engine
dies or hangs goes on on another engine from the tokens the client has.

Without Serve: the ingress's runner over two real engines, the first failing after a few
outputs (its stream raises what a dead core, a dead replica or the step watchdog raises). The
client's outputs must be the uninterrupted run's, token for token and character for character
(greedy with logprobs and a stop string's hold-back, seeded sampling, a JSON schema), each
failure counted by reason, and past the limit the failure is the client's 503. A migrated
request's call to another ingress replica is routed again past refusals, and cancelled there
when the client leaves.

Behind Serve: tests/cluster/test_serve_migration.py.
"""

from __future__ import annotations

import asyncio

import pytest

from cluster.http.metrics import AppMetrics
from cluster.http.migration import MIGRATION_REASONS, Migration, migration_reason
from cluster.http.runner import RequestRunner
from cluster.replica.errors import ReplicaError
from engine import AsyncLLM, EngineArgs, SamplingParams
from engine.errors import EngineDeadError
from engine.structured_output.params import StructuredOutputsParams
from tests.cluster.helpers import until

LONG_STRING_SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 60}},
                      "required": ["text"]}
CASES = {
    # A stop string that never matches still holds its length less one back at each step: the
    # continuation must send exactly what the first engine held.
    "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2, stop=["@@@@"]),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True),
    "json": SamplingParams(temperature=1.0, seed=3, max_tokens=40,
                           structured_outputs=StructuredOutputsParams(json=LONG_STRING_SCHEMA)),
}
DEAD = EngineDeadError("engine core process (pid 1) exited with code -9")


@pytest.fixture(scope="module")
def engines(tiny_model):
    made = [AsyncLLM.from_engine_args(EngineArgs(tiny_model, max_model_len=256)) for _ in range(2)]
    yield made
    for e in made:
        e.shutdown()


class _Failing:
    """An engine whose stream of a request fails with `error` once it handed out `after`
    outputs carrying tokens (its request is aborted there, as a dead engine's is lost), for
    its first `times` requests."""

    def __init__(self, engine, after: int, error: BaseException, times: int = 1_000) -> None:
        self.engine, self.after, self.error, self.times = engine, after, error, times
        self.failed = 0

    async def generate(self, request):
        given = 0
        stream = self.engine.generate(request)
        try:
            async for out in stream:
                yield out
                given += bool(out.delta_token_ids)
                if given == self.after and not out.finished and self.failed < self.times:
                    self.failed += 1
                    raise self.error
        finally:
            await stream.aclose()


async def _run(runner, request):
    """What the client gets: every output, in order."""
    return [out async for _, out in runner.stream(0, request)]


def _answer(outs):
    """The client's view: the text and tokens its chunks add up to, and the last output."""
    return "".join(o.delta_text for o in outs), [t for o in outs for t in o.delta_token_ids], outs[-1]


def _migrations(metrics: AppMetrics) -> dict[str, float]:
    value = metrics.registry.get_sample_value
    return {r: value("pdserve:request_migrations_total", {"model_name": "m", "mode": "pd", "reason": r})
            for r in MIGRATION_REASONS}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_request_whose_engine_dies_mid_stream_goes_on_elsewhere_exactly_as_uninterrupted(engines, case):
    first, second = engines
    params = CASES[case]

    async def main():
        whole = [o async for o in second.generate(second.process("The river ran quietly past", params, "whole"))]
        metrics = AppMetrics("m", "pd")
        failing = _Failing(first, 3, DEAD)
        runner = RequestRunner(failing, metrics, resume=second.generate)
        outs = await _run(runner, first.process("The river ran quietly past", params, "r"))
        return whole, outs, failing, metrics

    whole, outs, failing, metrics = asyncio.run(asyncio.wait_for(main(), 120))
    text, ids, last = _answer(outs)
    expected = whole[-1].outputs[0]
    assert failing.failed == 1 and len(ids) > 3  # it failed mid-stream, and went on
    assert ids == expected.token_ids == last.outputs[0].token_ids  # no token repeated or lost
    assert text == expected.text == last.outputs[0].text  # no character repeated or lost
    assert last.finished and last.outputs[0].finish_reason == expected.finish_reason
    assert last.prompt_token_ids == whole[-1].prompt_token_ids  # usage counts the client's prompt
    if params.logprobs is not None:
        # Each chunk carries its own tokens' logprobs; together, the uninterrupted run's.
        assert sum((o.delta_logprobs or [] for o in outs), []) == expected.logprobs == last.outputs[0].logprobs
    assert _migrations(metrics) == {"replica_died": 0, "engine_died": 1, "engine_hung": 0}


def test_a_second_failure_migrates_again_and_past_the_limit_the_client_gets_the_failure(engines):
    first, second = engines
    params = CASES["seeded"]
    hung = EngineDeadError("engine core process silent for longer than engine_step_timeout_s=10")
    gone = ReplicaError("replica unavailable: actor died", replica_died=True)

    async def main():
        whole = [o async for o in second.generate(second.process("Once upon a time", params, "whole"))]
        metrics = AppMetrics("m", "pd")
        # Dies after 2 outputs; its continuation dies after 3 more (a replica gone), then runs.
        runner = RequestRunner(_Failing(first, 2, hung), metrics, resume=_Failing(second, 3, gone, times=1).generate)
        outs = await _run(runner, first.process("Once upon a time", params, "r"))
        limited = AppMetrics("m", "pd")
        never = RequestRunner(_Failing(first, 1, DEAD), limited, resume=_Failing(second, 1, DEAD).generate,
                              migration_limit=2)
        with pytest.raises(EngineDeadError):
            await _run(never, first.process("Once upon a time", params, "n"))
        off = AppMetrics("m", "pd")
        with pytest.raises(EngineDeadError):
            await _run(RequestRunner(_Failing(first, 1, DEAD), off, resume=second.generate, migration_limit=0),
                       first.process("Once upon a time", params, "o"))
        return whole, outs, metrics, limited, off

    whole, outs, metrics, limited, off = asyncio.run(asyncio.wait_for(main(), 120))
    text, ids, _ = _answer(outs)
    assert ids == whole[-1].outputs[0].token_ids and text == whole[-1].outputs[0].text
    assert _migrations(metrics) == {"replica_died": 1, "engine_died": 0, "engine_hung": 1}
    assert _migrations(limited) == {"replica_died": 0, "engine_died": 2, "engine_hung": 0}
    assert _migrations(off) == {r: 0 for r in MIGRATION_REASONS}
    for engine in engines:  # nothing left running on either engine, no block held
        core = engine.engine.core
        assert not core.has_unfinished_requests()
        assert core.kv_cache_manager.get_num_free_blocks() == core.num_kv_blocks


def test_only_a_failure_of_the_engine_migrates():
    assert migration_reason(ReplicaError("decode failed: KV load refused")) is None  # kv_load_failure_policy
    assert migration_reason(ReplicaError("prefill failed on its replica")) is None
    assert migration_reason(ValueError("bad")) is None
    assert migration_reason(ReplicaError("subscription broke", replica_died=True)) == "replica_died"
    assert migration_reason(DEAD) == "engine_died"


def test_the_continuation_carries_the_produced_tokens_as_prior_output():
    from engine.outputs import CompletionOutput, RequestOutput
    from tests.cluster.helpers import engine_request

    request = engine_request("r", [5, 6, 7], SamplingParams(max_tokens=10, min_tokens=4, prompt_logprobs=1))
    m = Migration(request, limit=1)
    assert m.continuation().prompt_token_ids == [5, 6, 7]  # nothing produced: run whole
    m = Migration(request, limit=1)
    m.seen(RequestOutput("r", None, [5, 6, 7], [CompletionOutput(0, "ab", [8, 9, 10])], False, delta_text="ab"))
    cont = m.continuation()
    assert cont.prompt_token_ids == [5, 6, 7, 8, 9, 10] and cont.request_id != "r"
    assert (cont.sampling_params.max_tokens, cont.sampling_params.min_tokens) == (7, 1)
    assert cont.sampling_params.prompt_logprobs is None and cont.kv_transfer_params.num_prior_output_tokens == 3
    assert not m.allows()  # the limit, 1, is reached


class _Streams:
    """A DeploymentHandle stand-in for `Ingress.resume`: its calls answer, in turn, a refusal
    (MigrationRefused, as the replica the request left answers) or a stream of `outputs`."""

    def __init__(self, *answers) -> None:
        self.answers, self.calls = list(answers), []
        self.resume = self

    def options(self, stream: bool):
        return self

    def remote(self, request, *, avoid, caller):  # by keyword: the ingress's router reads `avoid`
        self.calls.append(_Call(self.answers.pop(0)))
        return self.calls[-1]


class _Call:
    def __init__(self, answer) -> None:
        self.answer, self.cancelled, self.given = answer, False, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if isinstance(self.answer, BaseException):
            raise self.answer
        if self.given == len(self.answer):
            raise StopAsyncIteration
        self.given += 1
        return self.answer[self.given - 1]

    def cancel(self) -> None:
        self.cancelled = True


def test_a_migrated_request_is_routed_past_refusals_and_cancelled_on_its_replica_when_left():
    from cluster.http.migration import MigrationRefused, ReplicaResume
    from engine.outputs import CompletionOutput, RequestOutput
    from tests.cluster.helpers import engine_request

    def out(i):
        return RequestOutput("r", None, [], [CompletionOutput(0, "", [])], False, delta_token_ids=[i])

    refused = MigrationRefused("replica ingress-a cannot take a request migrated from ingress-a")
    handle = _Streams(refused, [out(1), out(2), out(3)])

    async def leave_after_one():
        stream = ReplicaResume(handle, "ingress-a", backoff_s=0.001)(engine_request())
        first = await stream.__anext__()
        await stream.aclose()  # the client went away
        return first

    assert asyncio.run(leave_after_one()).delta_token_ids == [1]
    assert [c.cancelled for c in handle.calls] == [True, True]  # the one it ran on: aborted there

    nowhere = _Streams(*[refused] * 4)

    async def refused_everywhere():
        return [o async for o in ReplicaResume(nowhere, "ingress-a", tries=4, backoff_s=0.001)(engine_request())]

    with pytest.raises(MigrationRefused):
        asyncio.run(refused_everywhere())
    assert len(nowhere.calls) == 4

    # Every other replica's engine failed too: the request waits (routed again, backing off)
    # until a replacement takes it, rather than failing at once.
    later = _Streams(*[refused] * 8, [out(7)])

    async def taken_by_a_replacement():
        return [o async for o in ReplicaResume(later, "ingress-a", backoff_s=0.001)(engine_request())]

    assert [o.delta_token_ids for o in asyncio.run(taken_by_a_replacement())] == [[7]]
    assert len(later.calls) == 9


def test_the_ingress_router_never_sends_a_migrated_request_back_to_the_replica_it_left():
    """Serve's own router picks the shorter queue, which is the failed replica's (its requests
    just failed): the ingress's router passes it over while another replica is there."""
    from dataclasses import dataclass
    from types import SimpleNamespace

    from cluster.http.ingress_router import IngressRouter, ingress_id, pass_over

    @dataclass(frozen=True)
    class ReplicaID:  # hashable, as Serve's (the locality rule returns a set of them)
        unique_id: str

    a, b = (SimpleNamespace(replica_id=ReplicaID(u)) for u in ("a", "b"))
    assert pass_over([a, b], ingress_id("a")) == [b]
    assert pass_over([a], ingress_id("a")) == [a]  # the only one: it refuses, the client gets its 503
    assert pass_over([a, b], None) == [a, b]
    router = object.__new__(IngressRouter)
    router.apply_locality_routing = lambda pending: {a.replica_id, b.replica_id}  # one node

    def chosen(kwargs):
        [rank] = asyncio.run(router.choose_replicas([a, b], SimpleNamespace(args=(), kwargs=kwargs)))
        return {r.replica_id.unique_id for r in rank}

    for _ in range(20):  # random choices: every one passes over "b"
        assert chosen({"avoid": ingress_id("b")}) == {"a"}
    assert chosen({}) == {"a", "b"}  # an HTTP request: Serve's two choices


def test_a_migrated_request_left_while_it_is_being_placed_is_cancelled_there():
    from cluster.http.migration import ReplicaResume
    from tests.cluster.helpers import engine_request

    class _Never(_Call):
        async def __anext__(self):
            await asyncio.get_running_loop().create_future()  # the replica has not answered yet

    handle = _Streams(None)
    handle.remote = lambda request, avoid, caller: handle.calls.append(_Never(None)) or handle.calls[-1]

    async def leave():
        task = asyncio.ensure_future(ReplicaResume(handle, "ingress-a")(engine_request()).__anext__())
        await until(lambda: handle.calls, "the call to go out")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(leave(), 30))
    assert [c.cancelled for c in handle.calls] == [True]
