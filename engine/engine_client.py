"""EngineClient: what serving code asks of an engine, wherever the engine runs.

Three kinds answer it: `engine.AsyncLLM` (the engine in this process, its core here or in a
child process), an engine replica reached over Ray (cluster.replica: the server in this
process with direct streaming, or ReplicaStreams over the per-step messages of routed
replicas), and the P/D flow over a prefill and a decode engine (cluster.pd). Every one takes
the EngineRequest the ingress built, as it is (engine/engine_request.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from engine.engine_request import EngineRequest
from engine.outputs import RequestOutput


class EngineClient(Protocol):
    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The request's cumulative outputs, the last one finished. Closing the iterator early
        aborts the request on its engine (its KV blocks freed) before the close returns. An
        engine that failed raises (EngineDeadError, or cluster.replica.errors.ReplicaError):
        the request was not at fault."""

    async def abort(self, request_id: str) -> None:
        """End a request from outside its stream (a no-op for one that ended)."""

    async def check_health(self) -> None:
        """Raise when this client cannot serve any more (its engine thread or core process
        died, a tensor-parallel rank is gone); bounded. What a client reaches through a router
        (Serve's replicas) is health-checked by that router, not here."""
