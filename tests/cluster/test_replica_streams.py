"""cluster.replica.replica_streams.ReplicaStreams against stand-in replicas: a request whose replica left
Serve's routing between its submit and the ingress's subscription (scale-down) runs again on
another replica when nothing came back yet; otherwise the failure reaches the caller."""

from __future__ import annotations

import asyncio
import contextvars
from types import SimpleNamespace

import pytest

from cluster.replica.errors import ReplicaError
from cluster.replica.replica_streams import ReplicaStreams
from engine.outputs import RequestDelta
from engine.sampling_params import SamplingParams
from tests.cluster.helpers import engine_request

PROMPT_IDS = [1, 2, 3]


class StandInReplicas:
    """The engine deployment's handle as ReplicaStreams uses it. `plan` lists, per submit, the
    replica it lands on and what a subscription to that replica then does: a list of batches
    to send, or an exception to raise."""

    def __init__(self, plan: list[tuple[str, object]]) -> None:
        self.plan = list(plan)
        self.behaviour: dict[str, object] = {}
        self.submits: list[str] = []
        self.avoided: list[list[str] | None] = []  # each submit's replicas for the router to pass over
        self.kv_params: list[object] = []  # each submit's kv_transfer_params
        self.aborts: list[tuple[str, str]] = []
        self.submit = SimpleNamespace(remote=self._submit)
        self.abort = SimpleNamespace(remote=self._abort)
        self.subscribe = SimpleNamespace(remote=self._subscribe)

    def options(self, stream: bool = False):
        return self

    async def _submit(self, request, ingress_id, avoid=None):
        self.avoided.append(avoid)
        kv_transfer_params = request.kv_transfer_params
        replica, behaviour = self.plan.pop(0)
        self.submits.append(replica)
        self.kv_params.append(kv_transfer_params)
        self.behaviour[replica] = behaviour
        return replica

    async def _abort(self, request_id, replica=None):
        self.aborts.append((request_id, replica))

    async def _subscribe(self, ingress_id, replica=None):
        behaviour = self.behaviour[replica]
        if isinstance(behaviour, BaseException):
            raise behaviour
        self.behaviour[replica] = []  # sent once: a later subscription finds nothing new
        for batch in behaviour:
            yield batch


def _run(handle, request_id="r1", kv_transfer_params=None):
    async def main():
        streams = ReplicaStreams(handle, "ingress-test")
        last = None
        async for out in streams.generate(engine_request(request_id, PROMPT_IDS, SamplingParams(max_tokens=2), prompt="hi",
                                                        kv_transfer_params=kv_transfer_params)):
            last = out
        await streams.close()
        return last

    return asyncio.run(asyncio.wait_for(main(), 30))


def _done(request_id="r1", tokens=(7, 8)):
    return [[RequestDelta(request_id, list(tokens), "xy", finished=True, finish_reason="length")]]


def test_a_request_whose_replica_left_routing_before_any_output_runs_on_another():
    gone = RuntimeError("ReplicaGone: replica A is gone (this is B)")
    handle = StandInReplicas([("A", gone), ("B", _done())])
    out = _run(handle)
    assert handle.submits == ["A", "B"]
    assert out.finished and out.outputs[0].token_ids == [7, 8]


def test_a_decode_resubmitted_elsewhere_computes_its_prompt_instead_of_loading_the_kv_again():
    """The leaving replica may have loaded (and so released) the transfer before it left; a
    second load would fail the request. The P/D flow releases the transfer either way."""
    from engine.kv_transfer_params import KVTransferParams

    gone = RuntimeError("ReplicaGone: replica A is gone (this is B)")
    handle = StandInReplicas([("A", gone), ("B", _done())])
    kv = KVTransferParams(transfer_id="t1", num_tokens=3, num_prior_output_tokens=1)
    assert kv.loads_remote_kv
    out = _run(handle, kv_transfer_params=kv)
    assert handle.submits == ["A", "B"] and handle.kv_params == [kv, kv.computed_locally()]
    assert not handle.kv_params[1].loads_remote_kv
    assert out.finished and out.outputs[0].token_ids == [7, 8]


def test_resubmission_is_bounded():
    gone = RuntimeError("ReplicaGone: replica is gone")
    handle = StandInReplicas([("A", gone), ("B", gone), ("C", gone), ("D", _done())])
    with pytest.raises(ReplicaError, match="ReplicaGone"):
        _run(handle)
    assert handle.submits == ["A", "B", "C"]


def test_after_output_or_on_another_failure_the_error_reaches_the_caller():
    died = RuntimeError("actor died")
    handle = StandInReplicas([("A", died), ("B", _done())])
    with pytest.raises(ReplicaError, match="actor died"):
        _run(handle)
    assert handle.submits == ["A"]  # a dead replica may have done anything: no silent retry

    # One token, then the replica's subscriptions end idle while it should hold the request.
    partial = [[RequestDelta("r1", [7], "x")]]
    handle = StandInReplicas([("A", partial), ("B", _done())])
    with pytest.raises(ReplicaError, match="no longer holds"):
        _run(handle)
    assert handle.submits == ["A"]  # tokens were delivered: never run again elsewhere


# Stands for Serve's request context: set while the ingress serves one HTTP request.
SERVING = contextvars.ContextVar("serving", default=None)


class RecordingReplicas(StandInReplicas):
    """Notes the context each subscription runs in; its first subscription is cancelled from
    outside (as Serve cancels a leaving request's child calls) when `cancel_first`."""

    def __init__(self, plan, cancel_first: bool = False) -> None:
        super().__init__(plan)
        self.cancel_first = cancel_first
        self.contexts: list[object] = []

    async def _subscribe(self, ingress_id, replica=None):
        self.contexts.append(SERVING.get())
        if self.cancel_first and len(self.contexts) == 1:
            raise asyncio.CancelledError  # the call, not the ingress's task, is cancelled
        async for batch in super()._subscribe(ingress_id, replica):
            yield batch


def test_the_subscription_is_no_child_of_the_request_that_opened_it():
    async def main():
        SERVING.set("http-request-1")  # the request whose submit needs the subscription
        handle = RecordingReplicas([("A", _done())])
        streams = ReplicaStreams(handle, "ingress-test")
        outs = [o async for o in streams.generate(engine_request("r1", PROMPT_IDS, SamplingParams(max_tokens=2), prompt="hi"))]
        await streams.close()
        return handle, outs

    handle, outs = asyncio.run(asyncio.wait_for(main(), 30))
    assert handle.contexts == [None] and outs[-1].finished


def test_a_subscription_cancelled_from_outside_is_opened_again():
    handle = RecordingReplicas([("A", _done())], cancel_first=True)
    out = _run(handle)
    assert len(handle.contexts) == 2  # listened again, and the request got its tokens
    assert out.finished and out.outputs[0].token_ids == [7, 8]


def test_a_replica_whose_engine_failed_is_passed_over_by_the_next_submits_but_a_leaving_one_is_not():
    async def main():
        handle = StandInReplicas([("A", RuntimeError("engine failed: EngineDeadError('core exited')")),
                                  ("B", _done("r2")), ("C", RuntimeError("ReplicaGone: C is gone")), ("D", _done("r3"))])
        streams = ReplicaStreams(handle, "ingress-test")
        for request_id in ("r1", "r2", "r3"):
            try:
                async for _ in streams.generate(engine_request(request_id, PROMPT_IDS, SamplingParams(max_tokens=2))):
                    pass
            except ReplicaError:
                assert request_id == "r1"  # A failed under it: the client's 503, or a migration
        await streams.close()
        return handle

    handle = asyncio.run(asyncio.wait_for(main(), 30))
    assert handle.submits == ["A", "B", "C", "D"]
    # A failed: the router is told to pass it over; C only left routing (resubmitted, not avoided).
    assert handle.avoided == [None, ["A"], ["A"], ["A"]]
