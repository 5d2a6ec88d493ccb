"""The OpenAI-compatible HTTP ingress (a Serve deployment with a FastAPI app).

A route turns its body into a Job (cluster/http/chat.py, cluster/http/completions.py: tokenized,
chat template included, and validated exactly as the engine will, so bad input is a 400 before
any engine sees it); the ingress admits the job, runs each of its requests (cluster/pd/: on its
own engine with direct streaming, else on the engine replicas, prefill then decode in P/D) and
streams or returns the answer. Leaving a request early (client disconnect, error) cancels it on
the engines, which frees its KV blocks and its transfer. Errors: cluster/http/errors.py. The
path of one request: docs/architecture.md#the-path-of-one-request.
"""

# No `from __future__ import annotations`: FastAPI must see the body models as real types
# (Serve's class-based ingress re-wraps the methods, and string annotations are not resolved).
import asyncio
import dataclasses
import os
import time
import uuid
import weakref
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve

from cluster.http import lora, pooling
from cluster.http import openai_format as fmt
from cluster.http import openai_models as om
from cluster.http import pooling_models as pm
from cluster.http import tokenize as tokenizer_routes
from cluster.http.anthropic_messages import MessagesRequest, count_tokens, messages_job
from cluster.http.auth import ApiKeyCheck, install_api_key_check
from cluster.http.body_limits import BodyLimits, install_body_limits
from cluster.http.cached_call import CachedCall
from cluster.http.chat import chat_job
from cluster.http.completions import completion_job
from cluster.http.control_answers import scale_response, status_response
from cluster.http.errors import (
    OpenAIError,
    install_error_handlers,
    overloaded,
    queue_full,
    rejecting,
    replica_error,
)
from cluster.http.ingress_router import ingress_id
from cluster.http.metrics import AppMetrics, push_forever
from cluster.http.migration import ReplicaResume, resume_here
from cluster.http.protocol import ChatCompletionRequest, CompletionRequest
from cluster.http.reasoning import get_reasoning_parser
from cluster.http.responses import ResponsesRequest, responses_job
from cluster.http.responses_models import Response as ResponsesResponse
from cluster.http.runner import RequestRunner
from cluster.http.served_model import DATA_LINES, Job, ServedModel, SSEFormat
from cluster.http.settings import IngressSettings
from cluster.http.streams import merged
from cluster.http.tool_parsers import get_tool_parser
from cluster.pd.placement import PrefillPlacement, RoleCounts
from cluster.pd.serve_peers import ServePD
from cluster.replica.replica_streams import ReplicaStreams
from cluster.replica.server import EngineServer
from cluster.roles import Role
from cluster.tasks import detached_task
from engine.engine_client import EngineClient
from engine.engine_request import EngineRequest
from engine.llm_engine import load_processor
from engine.outputs import RequestOutput
from kvstore.store_actor import app_store

# Bound on each call to the Coordinator (/health, /metrics, /status, the metrics push): Serve
# holds a call to a deployment with no running replica (a Coordinator being replaced) until one
# runs. Past it: a 503 with Retry-After. /scale may wait on Serve's controller: a longer bound.
_COORDINATOR_CALL_S = 10.0
_SCALE_CALL_S = 30.0
# How old an answer /health may give (cluster.http.cached_call).
_HEALTH_MAX_AGE_S = 1.0

app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
install_error_handlers(app)
# The check of this process's ingress replica (one per process), set when it starts.
_api_keys: ApiKeyCheck | None = None
install_api_key_check(app, lambda: _api_keys)
# The body limits of this process's ingress replica, set when it starts.
_body_limits: BodyLimits | None = None
install_body_limits(app, lambda: _body_limits)


def _own_handle(handle):
    return None if handle is None else serve.get_deployment_handle(handle.deployment_name, handle.app_name)


@serve.ingress(app)
class Ingress:
    coordinator_call_s = _COORDINATOR_CALL_S  # an attribute: Serve's wrapper copies the module's globals
    def __init__(self, prefill, decode, coordinator, settings: IngressSettings) -> None:
        global _api_keys, _body_limits
        _api_keys = ApiKeyCheck(settings.api_key_digests, settings.metrics_without_key)
        _body_limits = settings.body_limits
        self.mode = settings.mode
        # Handles made in this replica, not the ones built with the app: Serve picks gRPC or
        # Ray actor calls per handle from the environment of the process that makes it
        # (RAY_SERVE_THROUGHPUT_OPTIMIZED, cluster.launch.serve_env), so the cluster's own setting
        # decides, whoever ran `serve.run` (a driver without it would pin actor calls).
        prefill, decode, coordinator = (_own_handle(h) for h in (prefill, decode, coordinator))
        self.prefill, self.decode, self.coordinator = prefill, decode, coordinator
        engine_args = settings.engine_args
        tokenizer, processor = load_processor(engine_args.create_engine_config())
        self.served = ServedModel(settings.served_model_name, engine_args.model, tokenizer, processor,
                              fmt.TokenText(tokenizer), engine_args.allowed_local_media_path,
                              tool_parser=(None if settings.tool_call_parser is None
                                           else get_tool_parser(settings.tool_call_parser)),
                              reasoning_parser=(None if settings.reasoning_parser is None
                                                else get_reasoning_parser(settings.reasoning_parser)),
                              enable_auto_tool_choice=settings.enable_auto_tool_choice,
                              loras=lora.lora_registry(settings.served_model_name, settings.lora_modules, processor,
                                                  engine_args.enable_lora, settings.lora_runtime_updates),
                              limits=settings.request_limits, max_prompts=settings.max_pending_requests,
                              prompt_tokens_details=settings.enable_prompt_tokens_details,
                              priority_scheduling=engine_args.scheduling_policy == "priority",
                              strict_schemas=settings.structured_outputs_config.strict_schemas)
        self.max_pending = settings.max_pending_requests
        CompletionRequest.max_prompts = self.max_pending  # this process's bound, counted while parsing
        self._share_coordinator_calls()
        loras = self.served.loras  # run-time adapter changes of other ingress replicas, followed
        self.lora_follower = (lora.LoRAFollower(loras, lambda: self._ask_coordinator("lora_table", timeout_s=2.0))
                              if loras is not None and loras.runtime_updates else None)
        self.ingress_id = ingress_id(serve.get_replica_context().replica_id.unique_id)
        # --direct-streaming: this replica's own engine (an EngineServer in this process) runs
        # the colocated (or decode) half of every request, called in process. Otherwise those
        # run on engine replicas, whose outputs come as one message per engine step.
        direct = settings.direct
        self.direct = EngineServer(**direct.server_kwargs) if direct is not None else None
        self.report_period_s = direct.report_period_s if direct is not None else None
        self.engines: EngineClient = (self.direct if self.direct is not None else
                                      ReplicaStreams(decode if self.mode == "pd" else prefill, self.ingress_id))
        self.metrics = AppMetrics(self.served.model_name, self.mode)
        self._pusher: asyncio.Task | None = None  # sends self.metrics to the Coordinator on change
        placement = pd = None
        if self.mode == "pd":
            counts = RoleCounts(coordinator)
            placement = PrefillPlacement(settings.local_prefill, counts, settings.prefill_fallback, counts.live)
            # With this replica's own decode engine, prompt KV comes back in the prefill's reply.
            inbox = self.direct.kv_inbox() if self.direct is not None else None
            pd = ServePD(prefill, self.engines, app_store(settings.app_name), settings.load_failure_policy, inbox)
        # Where a request whose engine died or hung goes on (docs/pd.md#decode-migration): another
        # ingress replica's own engine, or the routed engine replicas.
        resume = (self.engines.generate if self.direct is None else
                  ReplicaResume(serve.get_deployment_handle("Ingress", settings.app_name), self.ingress_id))
        self.runner = RequestRunner(self.engines, self.metrics, self.served.loras, placement, pd,
                                    resume if settings.migration_limit else None, settings.migration_limit)
        self._pending: dict[object, int] = {}  # admission token -> prompts it holds
        self.created = settings.created or int(time.time())
        if self.direct is not None:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                # Built off an event loop (Serve 2.60 runs the constructor on the replica's
                # loop): Serve's first health check, right after construction, starts them.
                pass
            else:
                self.direct.start_reporting(self.report_period_s)

    def _share_coordinator_calls(self) -> None:
        """/health is open to anyone (load balancers): however often it is asked, the
        Coordinator hears of it from this replica at most once a second. /metrics shares one
        call among the scrapes that come while it runs (a flood makes one call at a time), but
        a scrape never answers older figures than one before it did: Prometheus takes a
        counter that goes down for a reset."""
        self._replicas = CachedCall(lambda: self._ask_coordinator("replicas"), _HEALTH_MAX_AGE_S)
        self._scrape = CachedCall(lambda: self._ask_coordinator("scrape", self.ingress_id, self.metrics.snapshot()),
                                  0.0)

    # ---- this replica's own engine (--direct-streaming), called by Serve ------------------
    async def check_health(self) -> None:
        if self.direct is not None:
            self.direct.start_reporting(self.report_period_s)
        # This replica's own engine raises once it (or its core) died; routed replicas are
        # Serve's to check.
        await self.engines.check_health()

    async def resume(self, request: EngineRequest, avoid: str, caller=None) -> AsyncIterator[RequestOutput]:
        """A request migrated from ingress replica `avoid`, whose engine failed, on this one's."""
        async for out in resume_here(self.direct, request, avoid, self.ingress_id, caller):
            yield out

    def inter_deployment_calls(self) -> str:
        """"grpc" or "actor": how this replica's calls to other deployments travel."""
        handle = self.prefill or self.decode or self.coordinator
        return "actor" if handle.handle_options._by_reference else "grpc"

    def processes(self) -> dict:
        """This replica's pid and its engine core processes' (none without --direct-streaming),
        for operators and tests."""
        if self.direct is not None:
            return self.direct.processes()
        return {"replica": os.getpid(), "engine_cores": []}

    async def __del__(self) -> None:
        # Serve has let in-flight requests finish (graceful_shutdown_timeout_s). It calls this
        # even when the constructor failed part way.
        direct = getattr(self, "direct", None)
        if direct is not None:
            await direct.shutdown()

    # ---- running a route's job --------------------------------------------------------
    async def respond(self, job: Job) -> Response:
        """Admit the job, run every request; stream `job.chunks(merged outputs)` as SSE or
        return `job.whole(finals)`."""
        requests, n = job.requests, job.n
        if len(requests) > self.max_pending:
            what = f"{len(requests) // n} prompts x n={n}" if n > 1 else f"{len(requests)} prompts"
            raise OpenAIError(400, f"the request holds {what} = {len(requests)} sequences; at most "
                              f"{self.max_pending} per request", param="n" if n > 1 else "prompt")
        token = self._admit(len(requests))
        if self._pusher is None:
            self._pusher = detached_task(push_forever(self.metrics, lambda snapshot: self._ask_coordinator(
                "report_ingress_metrics", self.ingress_id, snapshot)))
        # Engine ids are unique even when a client reuses its request_id (it stays the response id).
        suffix = uuid.uuid4().hex[:8]
        outputs = merged([self.runner.stream(i, dataclasses.replace(r, request_id=f"{job.request_id}-{i}-{suffix}"))
                          for i, r in enumerate(requests)])
        if job.stream:
            body = self._sse(outputs, job.chunks, token, job.sse)
            # A client gone before the body starts leaves the generator unstarted (its finally
            # never runs); its admission is then returned when the generator is collected.
            weakref.finalize(body, self._release, token)
            return StreamingResponse(body, media_type="text/event-stream")
        try:
            finals: list[RequestOutput | None] = [None] * len(requests)
            async for i, out in outputs:
                finals[i] = out
            return fmt.json_response(job.whole(finals))
        except Exception as e:
            raise replica_error(e) from e
        finally:
            self._release(token)

    # ---- admission and running ----------------------------------------------------------
    @property
    def pending(self) -> int:
        return sum(self._pending.values())

    def _admit(self, n: int) -> object:
        if self.pending + n > self.max_pending:
            raise queue_full(f"server is at its limit of {self.max_pending} pending requests "
                             "(--max-pending-requests); retry later")
        token = object()
        self._pending[token] = n
        return token

    def _release(self, token: object) -> None:
        self._pending.pop(token, None)  # idempotent: stream end and finalizer may both call it

    async def _sse(self, outputs, chunks, token, wire: SSEFormat = DATA_LINES) -> AsyncIterator[str]:
        try:
            async for piece in chunks(outputs):
                yield wire.piece(piece)
        except Exception as e:
            yield wire.piece(wire.failure(replica_error(e)))
        finally:
            self._release(token)
        if wire.done:
            yield fmt.sse("[DONE]")

    async def _ask_coordinator(self, method: str, *args, timeout_s: float | None = None):
        timeout_s = self.coordinator_call_s if timeout_s is None else timeout_s
        try:
            # Shielded: past the bound the client gets its 503, but the call is not cancelled
            # inside the Coordinator (a scale half applied would be worse than a late one).
            return await asyncio.wait_for(asyncio.shield(getattr(self.coordinator, method).remote(*args)), timeout_s)
        except Exception as e:  # gone, restarting, or too slow: not an answer the client can use
            raise overloaded(f"coordinator unavailable: {type(e).__name__}") from e

    # ---- routes -------------------------------------------------------------------------
    # A route's `response_model` documents its JSON answer in /openapi.json; the route returns
    # a Response it built (the JSON, or an SSE stream with "stream": true), which FastAPI sends
    # as it is.
    @app.post("/v1/completions", response_model=om.CompletionResponse)
    async def completions(self, body: CompletionRequest) -> Response:
        await self._follow_loras(body.model)
        return await self.respond(completion_job(self.served, body))

    @app.post("/v1/chat/completions", response_model=om.ChatCompletionResponse)
    async def chat_completions(self, body: ChatCompletionRequest) -> Response:
        await self._follow_loras(body.model)
        if body.image_urls():
            # Off the event loop: decoding an image takes up to ~0.5 s (--max-image-pixels),
            # during which every stream of this replica would wait.
            return await self.respond(await asyncio.to_thread(chat_job, self.served, body))
        return await self.respond(chat_job(self.served, body))

    @app.post("/v1/responses", response_model=ResponsesResponse)
    async def responses(self, body: ResponsesRequest) -> Response:
        await self._follow_loras(body.model)
        return await self.respond(responses_job(self.served, body))

    # Anthropic's Messages API (cluster.http.anthropic_messages; errors in its shape: errors.py).
    @app.post("/v1/messages")
    async def messages(self, body: MessagesRequest) -> Response:
        await self._follow_loras(body.model)
        return await self.respond(messages_job(self.served, body))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(self, body: MessagesRequest) -> Response:
        return JSONResponse(count_tokens(self.served, body))

    # Pooling models (cluster/http/pooling.py, docs/pooling.md#endpoints): embeddings and scores.
    @app.post("/v1/embeddings", response_model=pm.EmbeddingResponse)
    async def embeddings(self, body: pm.EmbeddingRequest) -> Response:
        return await self.respond(pooling.embedding_job(self.served, body))

    @app.post("/v1/score", response_model=pm.ScoreResponse)
    async def score(self, body: pm.ScoreRequest) -> Response:
        return await self.respond(pooling.score_job(self.served, body))

    @app.post("/rerank", response_model=pm.RerankResponse)
    @app.post("/v1/rerank", response_model=pm.RerankResponse)
    async def rerank(self, body: pm.RerankRequest) -> Response:
        return await self.respond(pooling.rerank_job(self.served, body))

    async def _follow_loras(self, model) -> None:
        if self.lora_follower is not None:
            await self.lora_follower.before(model if isinstance(model, str) else None)

    # vLLM's tokenizer routes: the ingress's tokenizer answers, no engine is asked.
    @app.post("/tokenize")
    async def tokenize(self, body: tokenizer_routes.TokenizeRequest) -> om.TokenizeResponse:
        return tokenizer_routes.tokenize(self.served, body)

    @app.post("/detokenize")
    async def detokenize(self, body: tokenizer_routes.DetokenizeRequest) -> om.DetokenizeResponse:
        return tokenizer_routes.detokenize(self.served, body)

    @app.get("/tokenizer_info")
    async def tokenizer_info(self) -> om.TokenizerInfoResponse:
        return tokenizer_routes.tokenizer_info(self.served)

    @app.get("/health")
    async def health(self) -> Response:
        replicas = await self._replicas.get()  # a 503 while it restarts: not healthy yet
        roles = {r.role for r in replicas}
        needed = {Role.PREFILL, Role.DECODE} if self.mode == "pd" else {Role.COLOCATED}
        if not needed <= roles:
            raise overloaded(f"no live replica yet for {sorted(str(r) for r in needed - roles)}")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(self) -> om.ModelList:
        served = self.served
        adapters = [] if served.loras is None else served.loras.models(self.created, served.processor.max_model_len)
        base = om.ModelCard(id=served.model_name, created=self.created, root=served.model_dir, parent=None,
                         max_model_len=served.processor.max_model_len)
        return om.ModelList(data=[base, *adapters])

    # vLLM's run-time LoRA routes (docs/lora.md#serving): on with --enable-lora-runtime-updating or
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING=true; they change this ingress replica's adapters.
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, body: lora.LoadLoRAAdapterRequest) -> Response:
        loras = self._runtime_loras()
        with rejecting(body):
            loras.add(body.lora_name, body.lora_path)
        try:  # the other ingress replicas follow the Coordinator's table
            await self._ask_coordinator("lora_set", body.lora_name, body.lora_path)
        except OpenAIError:
            loras.follow({body.lora_name: None})  # not loaded anywhere, then
            raise
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, body: lora.UnloadLoRAAdapterRequest) -> Response:
        await self._runtime_loras().unload(body.lora_name)
        await self._ask_coordinator("lora_set", body.lora_name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    def _runtime_loras(self):
        loras = self.served.loras
        if loras is None or not loras.runtime_updates:
            raise OpenAIError(404, "run-time LoRA updates are off: start the server with --enable-lora and "
                              "--enable-lora-runtime-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)",
                              "not_found_error")
        return loras

    @app.get("/metrics")
    async def metrics_text(self) -> Response:
        replicas, requests = await self._scrape.get()
        return Response(self.metrics.render(replicas, requests), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/status")
    async def status(self) -> JSONResponse:
        return status_response(await self._ask_coordinator("status"))

    @app.post("/scale")
    async def scale(self, request: Request) -> Response:
        """`{"prefill": N, "decode": M}` -> 202 with the target (the Coordinator decides)."""
        try:
            body = await request.json()
        except ValueError as e:
            raise OpenAIError(400, f"malformed JSON body: {e}") from e
        return scale_response(await self._ask_coordinator("scale", body, timeout_s=_SCALE_CALL_S))
