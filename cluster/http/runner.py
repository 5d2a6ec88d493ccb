"""How the ingress runs each engine request of a job: whole on one engine (colocated, or a
P/D prompt prefilled where it decodes), or split over a Prefill replica and its decode engine
(cluster.pd), with the latency metrics, the LoRA adapter's use count, where the prompt
prefills and the decode-only fallback kept around it.

`RequestRunner.stream` is the one async generator between a job's chunks and the engine's own
stream (or the P/D flow): each output crosses as few frames as the path allows
(docs/architecture.md#the-path-of-one-request). Leaving a request early (client disconnect,
error) closes its stream at once, which aborts it on its engines and frees its KV blocks and
its transfer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import nullcontext

from cluster.http.errors import OpenAIError
from cluster.http.lora import LoRARegistry
from cluster.http.metrics import AppMetrics
from cluster.http.migration import (
    DEFAULT_MIGRATION_LIMIT,
    Migration,
    MigrationRefused,
    Resume,
    migration_reason,
)
from cluster.http.streams import RequestClock
from cluster.pd.placement import PrefillPlacement, PrefillUnavailable, Route
from cluster.pd.serve_peers import ServePD
from cluster.replica.errors import ReplicaError
from engine.engine_client import EngineClient
from engine.engine_request import EngineRequest
from engine.errors import EngineDeadError
from engine.outputs import RequestOutput
from engine.structured_output.backend import GRAMMAR_FAILURE

logger = logging.getLogger(__name__)


class RequestRunner:
    def __init__(self, engines: EngineClient, metrics: AppMetrics, loras: LoRARegistry | None = None,
                 placement: PrefillPlacement | None = None, pd: ServePD | None = None,
                 resume: Resume | None = None, migration_limit: int = DEFAULT_MIGRATION_LIMIT) -> None:
        """`engines`: where a request runs whole (this ingress's own engine, or routed engine
        replicas). P/D: `placement` decides where each prompt prefills and `pd` runs the
        ones it sends to a prefill replica (cluster.pd.serve_peers.ServePD, or any object
        with its `generate(request, prefill_timeout_s)`). `resume`: where a request whose
        engine failed goes on (cluster.http.migration), at most `migration_limit` times;
        None: nowhere, the failure is the client's 503."""
        self.engines, self.metrics, self.loras = engines, metrics, loras
        self.placement, self.pd = placement, pd
        self.resume, self.migration_limit = resume, migration_limit

    async def stream(self, index: int, request: EngineRequest) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(index, output) for each of the request's cumulative outputs. An engine-side failure
        (a dead replica, finish_reason "error": a KV load, a core that could not take it) is
        raised, so the client gets a 503 in OpenAI's error shape, never a 200 carrying a
        partial answer, whatever the mode and wherever the prompt ran."""
        clock = RequestClock(self.metrics, len(request.prompt_token_ids))
        status, route, outputs = "error", None, None
        lora = request.lora_request
        migration = Migration(request, self.migration_limit)
        failure = None  # the engine failure the request last migrated from
        try:
            with self.loras.using(lora) if self.loras is not None and lora is not None else nullcontext():
                route = self._route(request)
                outputs = self._outputs(request, route)
                while True:
                    try:
                        async for out in outputs:
                            if route is not None:
                                route.first_output(out)
                            clock.output(out)
                            if out.finished and out.outputs[0].finish_reason == "error":
                                raise _failure(out.outputs[0].stop_reason)
                            migration.seen(out)
                            yield index, out
                        break
                    except PrefillUnavailable as e:
                        # Raised by the prefill call only, before the client got anything: the
                        # prompt starts again on its decode engine (docs/pd.md#decode-only-fallback).
                        if clock.last is not None or route is None:
                            raise
                        await outputs.aclose()
                        route.fall_back(e)
                        self.metrics.pd_fallback(e.reason)
                        outputs = self.engines.generate(request)
                    except (ReplicaError, EngineDeadError) as e:
                        # Its engine died or hung: the request goes on elsewhere from what the
                        # client has (docs/pd.md#decode-migration), or the client gets its 503.
                        reason = migration_reason(e)
                        if isinstance(e, MigrationRefused):
                            # No other replica could take it: the client hears why it left.
                            raise ReplicaError(f"{failure} (no other replica took the request: {e})") from e
                        if reason is None or self.resume is None or not migration.allows():
                            raise
                        failure = e
                        await outputs.aclose()
                        self.metrics.request_migration(reason)
                        logger.warning("request %s migrates (%s, %d of at most %d): %s", request.request_id,
                                       reason, migration.count + 1, migration.limit, e)
                        outputs = migration.resumed(self.resume(migration.continuation()))
            status = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            raise
        finally:
            if outputs is not None:
                await outputs.aclose()  # now, not when collected: aborted on its engines first
            if route is not None:
                route.end()
            clock.end(status)

    def _route(self, request: EngineRequest) -> Route | None:
        if self.placement is None:
            return None
        route = self.placement.route(len(request.prompt_token_ids))
        if route.fallback is not None:
            self.metrics.pd_fallback(route.fallback)
        elif not route.remote:
            self.metrics.local_prefill()
        return route

    def _outputs(self, request: EngineRequest, route: Route | None) -> AsyncIterator[RequestOutput]:
        if route is not None and route.remote:
            if request.pooling_params is not None:  # prefill only: the Prefill replica answers it
                return self.pd.pool(request, route.timeout_s)
            return self.pd.generate(request, route.timeout_s)
        return self.engines.generate(request)


def _failure(reason) -> Exception:
    """An engine's "error" finish as what the client gets. A grammar that rejects the sampled
    token means no token satisfied every constraint of the request (its grammar and
    allowed_token_ids or logit_bias share none): the request's fault, a 400 that a retry would
    get again. Anything else failed on the replica: a 503."""
    if isinstance(reason, str) and reason.startswith(GRAMMAR_FAILURE):
        return OpenAIError(400, "no token satisfies every constraint of the request: its structured output "
                           "(grammar) and allowed_token_ids / logit_bias leave nothing to sample "
                           f"({reason[:200]})", param="structured_outputs")
    return ReplicaError(f"the engine failed the request: {reason}")
