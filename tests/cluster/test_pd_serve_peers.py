"""ServePeers with a direct-streaming ingress's inbox (cluster.pd.serve_peers, kvstore.handoff), with
stand-in handles: what the prefill call asks for, where a handed-back KV goes, what a failed
call becomes, and what cleanup releases. No Ray is started."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from cluster.pd.serve_peers import ServePeers
from cluster.pd.split import prefill_request
from cluster.replica.errors import ReplicaError
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from kvstore.handoff import Inbox, KVHandoff, max_reply_kv_bytes
from tests.cluster.helpers import RecordingStore, engine_request


class _Response:
    """A DeploymentResponse stand-in: awaitable once, cancellable."""

    def __init__(self, result=None, error: BaseException | None = None) -> None:
        self.result, self.error, self.cancelled = result, error, False

    def __await__(self):
        if self.error is not None:
            raise self.error
        return self.result
        yield  # a generator, as __await__ must return an iterator

    def cancel(self) -> None:
        self.cancelled = True


class _Prefill:
    def __init__(self, response: _Response) -> None:
        self.response, self.calls = response, []
        self.prefill = self.prefill_handoff = self  # the reply with the KV, or (no inbox) without

    def remote(self, *args):
        self.calls.append(args)
        return self.response


def _peers(response: _Response) -> tuple[ServePeers, _Prefill, RecordingStore, Inbox]:
    prefill, store, inbox = _Prefill(response), RecordingStore(), Inbox()
    return ServePeers(prefill, decode_streams=None, store=store, inbox=inbox), prefill, store, inbox


def test_the_kv_in_the_reply_goes_to_the_inbox_and_cleanup_forgets_it_without_the_store():
    kv = torch.randn(2, 3)
    peers, prefill, store, inbox = _peers(_Response(KVHandoff("first-output", kv=kv)))
    params = SamplingParams(max_tokens=4)
    request = prefill_request(engine_request("r1", [1, 2], params), "t1")
    out = asyncio.run(peers.prefill(request))
    assert out == "first-output"
    # The caller's own reply bound travels with the call.
    assert prefill.calls == [(request, max_reply_kv_bytes())]
    assert torch.equal(inbox.claim("t1"), kv)
    asyncio.run(peers.cleanup("r1", "t1", unfinished=False))
    assert len(inbox) == 0 and store.released == []


def test_a_reply_without_the_kv_leaves_the_transfer_to_the_store():
    peers, _prefill, store, inbox = _peers(_Response(KVHandoff("first-output")))
    asyncio.run(peers.prefill(prefill_request(engine_request("r2", [1]), "t2")))
    assert inbox.claim("t2") is None  # not handed off: the store has it
    asyncio.run(peers.cleanup("r2", "t2", unfinished=False))
    assert store.released == ["t2"]


def _grpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def test_a_grpc_failure_of_the_prefill_call_is_a_retryable_pd_error():
    # Serve maps only UNAVAILABLE to a replica error; other statuses came through raw (a 500).
    response = _Response(error=_grpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    peers, _prefill, store, inbox = _peers(response)
    with pytest.raises(ReplicaError, match="DEADLINE_EXCEEDED: Deadline Exceeded") as e:
        asyncio.run(peers.prefill(prefill_request(engine_request("r3", [1]), "t3")))
    assert not e.value.replica_died
    asyncio.run(peers.cleanup("r3", "t3", unfinished=True))
    assert response.cancelled and store.released == ["t3"] and len(inbox) == 0


def test_a_reply_over_the_grpc_limit_names_the_setting_and_is_not_retryable():
    # What Serve's gRPC client raised for a 12 MB reply at its 4 MiB default: a retry would
    # fail the same way, so not a 503.
    error = _grpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (11799825 vs. 4194304)")
    peers, _prefill, store, _inbox = _peers(_Response(error=error))
    with pytest.raises(RuntimeError, match="over the gRPC message limit .*; raise RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH") as e:
        asyncio.run(peers.prefill(prefill_request(engine_request("r4", [1]), "t4")))
    assert not isinstance(e.value, ReplicaError)
    asyncio.run(peers.cleanup("r4", "t4", unfinished=True))
    assert store.released == ["t4"]


def test_the_pd_engine_runs_the_flow_over_its_peers_and_aborts_on_its_decode_engine():
    from cluster.pd.serve_peers import ServePD

    class _Decode:
        def __init__(self) -> None:
            self.aborted, self.requests = [], []

        async def generate(self, request):
            self.requests.append(request)
            yield RequestOutput(request.request_id, None, request.prompt_token_ids,
                                [CompletionOutput(0, "b", [8], "length")], finished=True, delta_text="b",
                                delta_token_ids=[8])

        async def abort(self, request_id):
            self.aborted.append(request_id)

    first = RequestOutput("r5", None, [1, 2], [CompletionOutput(0, "a", [7], "length")], finished=True,
                          delta_text="a", delta_token_ids=[7])
    decode, store = _Decode(), RecordingStore()
    pd = ServePD(_Prefill(_Response(first)), decode, store, "recompute")

    async def run():
        outs = [o async for o in pd.generate(engine_request("r5", [1, 2], SamplingParams(max_tokens=2)))]
        await pd.abort("r5")
        return outs

    outs = asyncio.run(run())
    assert [o.outputs[0].token_ids for o in outs][-1] == [7, 8] and outs[-1].finished
    [half] = decode.requests  # the decode half: prompt + the first token, one token left
    assert half.prompt_token_ids == [1, 2, 7] and half.max_tokens == 1
    assert decode.aborted == ["r5"]
