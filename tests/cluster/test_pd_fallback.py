"""Decode-only fallback (cluster.pd.placement, cluster.http.runner, docs/pd.md#decode-only-fallback), and the engine
hang watchdog behind Serve (docs/operations.md#engine-hang-watchdog).

Without Serve: the decision (no prefill replica on the board, their queue over its bound, a
prefill call over its time or whose replica died) over the real P/D flow (pd_flow through
ServePeers) with stand-in handles: the prompt runs whole on its decode engine, the prefill call
is cancelled and its transfer released, each case is counted by reason, and enforce_disagg
answers 503 with Retry-After instead.

Behind Serve, on the P/D app with direct streaming that this module shares with test_churn
and test_serve_pd_direct (`shared_direct_app`; each replacement takes tens of seconds here):
a stalled prefill (the Prefill replica's process stopped with SIGSTOP: alive, silent)
under 4 requests, each answered 200 with the healthy server's text (greedy and seeded) within
the stated bound; then a decode engine core stopped mid-request: a 503 with Retry-After within
engine_step_timeout_s, a failed health check, and a replaced replica.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import ray

from cluster.http.errors import replica_error
from cluster.http.metrics import AppMetrics
from cluster.http.runner import RequestRunner
from cluster.pd.placement import (
    FALLBACK_REASONS,
    PREFILL_TIMEOUT_COLD,
    PREFILL_TIMEOUT_SLACK,
    LocalPrefillRule,
    PrefillFallback,
    PrefillPlacement,
    PrefillUnavailable,
)
from cluster.pd.serve_peers import ServePD
from cluster.replica.errors import ReplicaError
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from tests.cluster.helpers import DIRECT_APP as APP
from tests.cluster.helpers import DIRECT_NAME as NAME
from tests.cluster.helpers import DIRECT_STEP_TIMEOUT_S as STEP_TIMEOUT_S
from tests.cluster.helpers import RecordingStore, engine_request, until

# ---- the decision, without Serve ------------------------------------------------------------


class _Response:
    """A DeploymentResponse stand-in: answers `result` (or raises `error`), or never when both
    are None; notes its cancellation."""

    def __init__(self, result=None, error: BaseException | None = None) -> None:
        self.result, self.error, self.cancelled = result, error, False
        self.waiting = 0  # callers awaiting an answer that never comes

    def __await__(self):
        if self.error is not None:
            raise self.error
        if self.result is None:
            self.waiting += 1
            yield from asyncio.get_running_loop().create_future().__await__()  # never set
        return self.result

    def cancel(self) -> None:
        self.cancelled = True


class _Prefill:
    """A Prefill deployment handle whose calls answer `response`."""

    def __init__(self, response: _Response) -> None:
        self.response, self.calls = response, []
        self.prefill = self

    def remote(self, request):
        self.calls.append(request.kv_transfer_params.transfer_id)
        return self.response


def _output(tokens: list[int], finish_reason: str | None = None) -> RequestOutput:
    return RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, "", list(tokens), finish_reason)],
                         finished=finish_reason is not None, delta_token_ids=list(tokens))


class _DecodeEngine:
    """The decode engine (an EngineClient): a whole request, as the local path runs it."""

    def __init__(self) -> None:
        self.requests: list[tuple] = []

    async def generate(self, request):
        self.requests.append((request.request_id, request.kv_transfer_params))
        yield _output([7])
        yield _output([7, 8], "length")


class _Case:
    """One request through the ingress's runner (PrefillPlacement) over the real P/D flow and
    the stand-ins."""

    def __init__(self, response: _Response, fallback: PrefillFallback | None = None,
                 live_prefill: int | None = 1, queue: int = 0) -> None:
        self.prefill, self.store, self.decode = _Prefill(response), RecordingStore(), _DecodeEngine()
        self.placement = PrefillPlacement(LocalPrefillRule(queue, 0), lambda role: 1, fallback or PrefillFallback(),
                                          lambda role: live_prefill)
        self.metrics = AppMetrics("m", "pd")
        self.runner = RequestRunner(
            self.decode, self.metrics, None, self.placement,
            ServePD(self.prefill, self.decode, self.store, "recompute"))

    @property
    def fallbacks(self) -> list[str]:
        """The fallbacks counted, by reason (pdserve:pd_fallback_total)."""
        value = self.metrics.registry.get_sample_value
        return [r for r in FALLBACK_REASONS
                for _ in range(int(value("pdserve:pd_fallback_total", {"model_name": "m", "mode": "pd", "reason": r})))]

    def run(self, prompt_len: int = 3):
        return self.runner.stream(0, engine_request("r", [1, 2, 3][:prompt_len], SamplingParams(max_tokens=2)))

    def outputs(self) -> list[list[int]]:
        async def collect():
            return [list(o.outputs[0].token_ids) async for _, o in self.run()]
        return asyncio.run(asyncio.wait_for(collect(), 30))  # a stalled prefill must not stall it


def test_a_prefill_call_over_its_bound_is_cancelled_released_and_the_prompt_runs_on_its_decode_engine():
    case = _Case(_Response(), PrefillFallback(prefill_timeout_s=0.05))
    started = time.monotonic()
    assert case.outputs() == [[7], [7, 8]]  # the decode engine's whole answer, from its first token
    # Not measured yet: the cold bound.
    assert time.monotonic() - started >= 0.05 * PREFILL_TIMEOUT_COLD
    [transfer] = case.prefill.calls
    assert case.prefill.response.cancelled and case.store.released == [transfer]
    assert case.decode.requests == [("r", None)]  # a plain request: no KV to load
    assert case.fallbacks == ["timeout"]
    assert case.placement.in_flight == {"remote": 0, "local": 0} and case.placement.remote_tokens == 0


def test_a_prefill_replica_or_engine_that_dies_during_the_call_falls_back_but_a_failing_engine_is_a_503():
    from engine.errors import EngineDeadError

    died = _Case(_Response(error=ray.exceptions.ActorDiedError()))
    assert died.outputs() == [[7], [7, 8]] and died.fallbacks == ["replica_died"]
    assert died.store.released == died.prefill.calls  # the flow's cleanup released it
    # The replica lives but its engine core was killed: raised as itself (Serve's gRPC path)
    # or as a RayTaskError of it (an actor call).
    gone = EngineDeadError("the engine core process (pid 7) exited with code -9")
    for error in (gone, ray.exceptions.RayTaskError("prefill", "EngineDeadError", gone).as_instanceof_cause()):
        dead = _Case(_Response(error=error))
        assert dead.outputs() == [[7], [7, 8]] and dead.fallbacks == ["engine_died"]
        assert dead.store.released == dead.prefill.calls and dead.decode.requests == [("r", None)]
    # The replica answered with its engine's failure, as a RayTaskError or (Serve's gRPC path)
    # as the exception itself: a 503 the client can retry, never a 500 without Retry-After.
    task_error = ray.exceptions.RayTaskError("prefill_handoff", "RuntimeError: engine failed", RuntimeError())
    for error in (task_error, RuntimeError("engine failed: EngineDeadError('core exited with code -9')")):
        failed = _Case(_Response(error=error))
        with pytest.raises(ReplicaError, match="prefill") as e:
            failed.outputs()
        assert not isinstance(e.value, PrefillUnavailable) and failed.fallbacks == [] and failed.decode.requests == []
        answer = replica_error(e.value)
        assert answer.status == 503 and answer.headers["Retry-After"]
        assert failed.store.released == failed.prefill.calls


def test_no_prefill_replica_on_the_board_falls_back_at_once_but_an_unknown_count_does_not():
    gone = _Case(_Response(), live_prefill=0)
    assert gone.outputs() == [[7], [7, 8]]
    assert gone.fallbacks == ["no_replicas"] and gone.prefill.calls == []  # never asked
    # Before the first count: the prefill is asked (its first token is the end: EOS).
    unknown = _Case(_Response(_output([4], "stop")), live_prefill=None)
    assert unknown.outputs() == [[4]] and unknown.fallbacks == [] and len(unknown.prefill.calls) == 1


def test_a_prefill_queue_at_its_bound_sends_the_next_prompt_to_its_decode_engine():
    async def run():
        case = _Case(_Response(), PrefillFallback(prefill_timeout_s=0, max_prefill_queue_size=2))
        waiting = [case.run() for _ in range(2)]
        firsts = [asyncio.ensure_future(g.__anext__()) for g in waiting]
        # Both start and wait on their prefill (no bound: 0).
        await until(lambda: case.prefill.response.waiting == 2, "both requests to wait on their prefill")
        assert case.placement.in_flight["remote"] == 2
        async def third_request():
            return [list(o.outputs[0].token_ids) async for _, o in case.run()]
        third = await asyncio.wait_for(third_request(), 30)  # never waits behind the queue
        assert third == [[7], [7, 8]] and case.fallbacks == ["queue"] and len(case.prefill.calls) == 2
        for f, g in zip(firsts, waiting):
            f.cancel()
            await asyncio.gather(f, return_exceptions=True)
            await g.aclose()
        assert case.placement.in_flight == {"remote": 0, "local": 0}

    asyncio.run(run())


def test_enforce_disagg_answers_503_with_retry_after_instead_of_falling_back():
    strict = PrefillFallback(enforce_disagg=True, prefill_timeout_s=0.05)
    for case in (_Case(_Response(), strict, live_prefill=0), _Case(_Response(), strict)):
        with pytest.raises(PrefillUnavailable) as e:
            case.outputs()
        answer = replica_error(e.value)
        assert answer.status == 503 and answer.headers["Retry-After"]
        assert case.decode.requests == [] and case.fallbacks == []
        assert case.store.released == case.prefill.calls  # a timed-out call is still cancelled and released


def test_the_bound_grows_with_the_prompt_and_the_queue_ahead_at_the_measured_pace():
    p = PrefillPlacement(LocalPrefillRule(), lambda role: 2, PrefillFallback(prefill_timeout_s=10))
    assert p.timeout_s(100) == 10 * PREFILL_TIMEOUT_COLD  # nothing measured yet
    p.pace.observe(1000, 2.0)  # 500 computed tokens per second
    assert p.timeout_s(100) == 10  # 0.2 s expected: the least bound
    assert p.timeout_s(10_000) == pytest.approx(PREFILL_TIMEOUT_SLACK * 20)
    p.remote_tokens = 10_000  # ahead of it, over two prefill replicas
    assert p.timeout_s(10_000) == pytest.approx(PREFILL_TIMEOUT_SLACK * 30)
    assert PrefillPlacement(LocalPrefillRule(), lambda role: 1, PrefillFallback(prefill_timeout_s=0)).timeout_s(9) is None


def test_a_prefill_answered_in_time_is_measured_without_its_cached_tokens():
    first = _output([4], "stop")
    first.num_cached_tokens = 2
    case = _Case(_Response(first))
    assert case.outputs() == [[4]] and case.fallbacks == []
    assert case.placement.pace.seconds(1) is not None and case.placement.pace._tokens == 1  # 3 - 2 cached


@pytest.mark.parametrize("field,value", [("prefill_timeout_s", -1), ("prefill_timeout_s", "10"),
                                         ("max_prefill_queue_size", -1), ("max_prefill_queue_size", 1.5)])
def test_bad_bounds_are_refused_naming_the_field(field, value):
    from engine.errors import ParameterError

    with pytest.raises(ParameterError, match=field) as e:
        PrefillFallback(**{field: value})
    assert e.value.field == field


# ---- behind Serve -----------------------------------------------------------------------------

ROLES = {"prefill", "decode"}
MAX_TOKENS = 16
# Two greedy requests (oracle: transformers) and two seeded samples: the healthy server's text.
REQUESTS = [("The river ran quietly past", {"temperature": 0}),
            ("A good engineer measures before", {"temperature": 0}),
            ("Once upon a time there was", {"temperature": 1.0, "seed": 11}),
            ("Hello! How can I help you", {"temperature": 0.8, "top_p": 0.9, "seed": 5})]
# The stated bound (docs/pd.md#decode-only-fallback): a request whose prefill replica stalls
# answers within the prefill call's bound (prefill_timeout_s, 10 s: the pace the healthy
# requests measured gives these short prompts no more) plus its own prefill and decode on the
# decode replica (under a second alone; up to 20 s allowed on this loaded 2-core machine).
ANSWER_BOUND_S = 10.0 + 20.0
# The watchdog's own delays (its checks every 0.1 s on the engine thread) and the HTTP path.
WATCHDOG_SLACK_S = 12.0


@pytest.fixture(scope="module")
def app(shared_direct_app):
    # Direct streaming: the ingress is the decode replica; every engine core in a child
    # process; every prompt of more than DIRECT_SHORT tokens (all of these) disaggregated, so each
    # stalled prefill is a fallback.
    assert shared_direct_app.config.prefill_timeout_s == 10.0  # the default, which the bound above states
    return shared_direct_app.url()


def _fallbacks(url: str) -> dict[str, float]:
    from tests.cluster.helpers import metric_value

    return {r: metric_value(url, "pdserve:pd_fallback_total", reason=r) for r in FALLBACK_REASONS}


def test_a_stalled_prefill_replica_leaves_every_request_answered_by_its_decode_replica_as_when_healthy(
        app, tiny_model):
    from tests.cluster.helpers import (
        assert_no_leaks,
        deployment_processes,
        hf_text,
        in_thread,
        openai_client,
        proc_stat,
        replicas,
        running,
        wait_for,
    )

    client = openai_client(app)

    def ask(prompt: str, sampling: dict) -> tuple[str, float]:
        started = time.monotonic()
        text = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, **sampling).choices[0].text
        return text, time.monotonic() - started

    healthy = [ask(p, s)[0] for p, s in REQUESTS]
    for (prompt, sampling), text in zip(REQUESTS, healthy):
        if sampling["temperature"] == 0:
            assert text == hf_text(tiny_model, prompt, MAX_TOKENS)
    before = _fallbacks(app)
    pid = deployment_processes("Prefill", APP)["replica"]  # the replica actor: alive, and silent
    start = proc_stat(pid)[19]
    os.kill(pid, signal.SIGSTOP)
    try:
        answers = [in_thread(ask, p, s) for p, s in REQUESTS]
        stalled = [a.result(timeout=ANSWER_BOUND_S + 60) for a in answers]
    finally:
        if running(pid, start):
            os.kill(pid, signal.SIGCONT)
    assert [text for text, _ in stalled] == healthy
    assert max(took for _, took in stalled) <= ANSWER_BOUND_S, stalled
    after = _fallbacks(app)
    assert {r: after[r] - before[r] for r in after} == {**{r: 0 for r in after}, "timeout": 4}
    # Whether Serve replaced the stopped replica meanwhile or it came back: both roles serve,
    # no block is held anywhere and the cancelled calls' transfers were released.
    wait_for(lambda: "prefill" in {r["role"] for r in replicas(app)}, "a prefill replica to report", 180, 0.5)
    assert_no_leaks(app, APP, ROLES)


def test_a_stopped_decode_core_is_failed_at_the_step_bound_its_requests_go_on_and_it_is_replaced(app, tiny_model):
    import requests

    from tests.cluster.helpers import (
        answers_exactly,
        deployment_processes,
        hf_text,
        in_thread,
        openai_client,
        proc_stat,
        running,
        sse_events,
        wait_for,
    )

    old = deployment_processes("Ingress", APP)
    [core] = old["engine_cores"]
    start = proc_stat(core)[19]
    body = {"model": NAME, "prompt": REQUESTS[0][0], "max_tokens": 480, "ignore_eos": True, "temperature": 0}
    stream = requests.post(f"{app}/v1/completions", json={**body, "stream": True}, stream=True, timeout=(10, 60))
    lines = stream.iter_lines(decode_unicode=True)
    assert stream.status_code == 200 and next(x for x in lines if x.startswith("data: {"))  # decoding

    def post() -> tuple[requests.Response, float]:
        r = requests.post(f"{app}/v1/completions", json=body, timeout=120)
        return r, time.monotonic()

    os.kill(core, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        answer = in_thread(post)  # in flight on the stopped core
        # The step watchdog fails the engine at its bound; then both requests migrate and wait
        # for Serve's replacement (docs/pd.md#decode-migration), or, where none took them within
        # the migration's bound, end as before: an error event, a 503 naming the bound.
        rest = sse_events(_Lines(lines))  # never hangs
        ended = time.monotonic() - stopped
        r, done = answer.result(timeout=120)
        errors = [e for e in rest if isinstance(e, dict) and "error" in e]
        if errors:
            assert errors[-1]["error"]["code"] == 503 and ended <= STEP_TIMEOUT_S + WATCHDOG_SLACK_S + 60, rest[-3:]
            assert r.status_code == 503 and r.headers["Retry-After"], r.text
            assert "engine_step_timeout_s" in r.json()["error"]["message"]
        else:
            assert rest[-1] == "[DONE]" and ended >= STEP_TIMEOUT_S  # held until the watchdog's bound
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 480, r.text
        assert done - stopped >= STEP_TIMEOUT_S
        # Its health check fails from then on: Serve replaces the replica, which answers.
        expected = hf_text(tiny_model, REQUESTS[0][0], 10)
        wait_for(answers_exactly(openai_client(app), NAME, REQUESTS[0][0], expected), "a replaced replica", 180, 2.0)
        assert deployment_processes("Ingress", APP)["replica"] != old["replica"]
        if not errors:  # the migrated answer is the uninterrupted run's
            again = requests.post(f"{app}/v1/completions", json=body, timeout=120)
            assert again.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
    finally:
        stream.close()
        if running(core, start):
            os.kill(core, signal.SIGCONT)


class _Lines:
    """The rest of a response's lines, as sse_events reads them."""

    def __init__(self, lines) -> None:
        self.lines = lines

    def iter_lines(self, decode_unicode: bool = True):
        return self.lines

