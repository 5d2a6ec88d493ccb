"""The OpenAI-compatible HTTP ingress (a Serve deployment with a FastAPI app).

It tokenizes (chat template included) and validates each request exactly as the engine will,
so bad input is a 400 before any replica sees it; then it runs the request through the
prefill and decode deployments (or the colocated one) and streams or returns the result.
Leaving a request early (client disconnect, error) cancels it on the replicas, which frees
its KV blocks and its transfer.
"""

# No `from __future__ import annotations`: FastAPI must see the body models as real types
# (Serve's class-based ingress re-wraps the methods, and string annotations are not resolved).
import asyncio
import dataclasses
import time
import uuid
import weakref
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.orchestrate import PDRequestError
from cluster import openai_format as fmt
from cluster.metrics import AppMetrics
from cluster.pd_serve import serve_colocated_generate, serve_pd_generate
from cluster.protocol import ChatCompletionRequest, CompletionRequest
from engine import EngineArgs
from engine.llm_engine import front_end
from engine.outputs import RequestOutput
from kvstore.store_actor import app_store

RETRY_AFTER_S = 1

app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(fmt.error_body(self.message, self.type, self.param, self.code or self.status),
                            status_code=self.status, headers=self.headers)


def _overloaded(message: str) -> OpenAIError:
    return OpenAIError(503, message, "service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})


@app.exception_handler(OpenAIError)
async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return exc.response()


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 becomes OpenAI's 400, naming the offending field."""
    err = exc.errors()[0] if exc.errors() else {}
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    # The param is the top-level field; the message keeps the path (which for unions also
    # names the type tried, e.g. prompt.str).
    param = loc[0] if loc else None
    if err.get("type") == "json_invalid":
        message, param = f"malformed JSON body: {err.get('msg', '')}", None
    elif err.get("type") == "missing" and len(loc) == 1:
        message = f"missing required field '{param}'"
    else:
        message = f"invalid value for '{'.'.join(loc)}': {err.get('msg', 'invalid')}"
    return OpenAIError(400, message, param=param).response()


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    """Anything unforeseen is still an OpenAI-shaped 500, never a bare text page."""
    return OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_server_error").response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return OpenAIError(exc.status_code, str(exc.detail), type_).response()


# Fields whose names start engine validation messages; anything else is reported on the prompt.
_PARAMS = {"temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop",
           "stop_token_ids", "logprobs", "n", "prompt", "prompt_token_ids"}


def _bad_request(e: ValueError, prompt_param: str = "prompt", logprobs_param: str = "logprobs") -> OpenAIError:
    message = str(e)
    head = message.split(" ", 1)[0]
    param = head if head in _PARAMS else prompt_param
    if param in ("prompt", "prompt_token_ids"):
        param = prompt_param
    elif param == "logprobs":
        param = logprobs_param
    return OpenAIError(400, message, param=param)


async def _merge(gens: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Interleave several async iterators as (index, item); closing the merge cancels them all."""
    if len(gens) == 1:
        try:
            async for item in gens[0]:
                yield 0, item
        finally:
            await gens[0].aclose()  # closing the merge closes the request now, not at GC
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, gen):
        try:
            async for item in gen:
                await queue.put((i, item))
        except Exception as e:  # handed to the consumer, which re-raises
            await queue.put((i, e))
        await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Timing:
    """Latency figures of one request as the client sees them."""

    def __init__(self, metrics: AppMetrics) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.last: float | None = None

    def tokens(self, out: RequestOutput) -> None:
        if not out.delta_token_ids:
            return
        now = time.monotonic()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
            if "queue_time_s" in out.metrics:
                self.metrics.queue.observe(out.metrics["queue_time_s"])
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now

    def done(self) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.start)


@serve.ingress(app)
class Ingress:
    def __init__(self, prefill, decode, coordinator, settings: dict) -> None:
        self.mode = settings["mode"]
        self.engine_handle = prefill  # the colocated deployment in colocated mode
        self.prefill, self.decode, self.coordinator = prefill, decode, coordinator
        self.model_dir = settings["model"]
        self.model_name = settings["served_model_name"]
        self.max_pending = settings["max_pending_requests"]
        self.load_failure_policy = settings.get("load_failure_policy", "fail")
        config = EngineArgs.from_kwargs(self.model_dir, **settings.get("engine_kwargs", {})).create_engine_config()
        self.tokenizer, self.processor = front_end(config)
        self.text_of = fmt.TokenText(self.tokenizer)
        self.store = app_store(settings["app_name"]) if self.mode == "pd" else None
        self.metrics = AppMetrics(self.model_name, self.mode)
        self._pending: dict[object, int] = {}  # admission token -> prompts it holds
        self.created = int(time.time())

    # ---- plumbing ---------------------------------------------------------------------------
    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist. Available: `{self.model_name}`.",
                              "not_found_error", param="model", code="model_not_found")

    def _validate(self, ids: list[int], params, prompt_param: str, logprobs_param: str = "logprobs"):
        """The request's params for this prompt, checked exactly as the engine will; an
        unset max_tokens becomes the room left in the context (so a P/D split knows when
        the prefill's token is the last one)."""
        try:
            self.processor.process({"prompt_token_ids": ids}, params)
        except ValueError as e:
            raise _bad_request(e, prompt_param, logprobs_param) from e
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=self.processor.max_model_len - len(ids))
        return params

    @property
    def pending(self) -> int:
        return sum(self._pending.values())

    def _admit(self, n: int) -> object:
        if self.pending + n > self.max_pending:
            raise _overloaded(f"server is at its limit of {self.max_pending} pending requests; retry later")
        token = object()
        self._pending[token] = n
        return token

    def _release(self, token: object) -> None:
        self._pending.pop(token, None)  # idempotent: stream end and finalizer may both call it

    def _run(self, prompt: dict, params, request_id: str) -> AsyncIterator[RequestOutput]:
        if self.mode == "pd":
            return serve_pd_generate(self.prefill, self.decode, self.store, prompt, params, request_id,
                                     self.load_failure_policy)
        return serve_colocated_generate(self.engine_handle, prompt, params, request_id)

    async def _timed(self, prompt: dict, params, request_id: str) -> AsyncIterator[RequestOutput]:
        timing = _Timing(self.metrics)
        status = "error"
        last = None
        try:
            async for out in self._run(prompt, params, request_id):
                timing.tokens(out)
                last = out
                yield out
            status = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            raise
        finally:
            timing.done()
            generated = len(last.outputs[0].token_ids) if last is not None else 0
            self.metrics.request_done(status, len(prompt["prompt_token_ids"]), generated)

    @staticmethod
    def _error(e: Exception) -> OpenAIError:
        if isinstance(e, BackPressureError):
            return _overloaded(f"engine replicas are at their queue limit; retry later ({e})")
        if isinstance(e, PDRequestError):
            return OpenAIError(503, f"request failed on a replica: {e}", "service_unavailable",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
        return OpenAIError(500, f"internal error: {type(e).__name__}: {e}", "internal_server_error")

    async def _respond(self, prompts: list[dict], params: list, request_id: str, stream: bool, chunks,
                       whole) -> Response:
        """Run every prompt; stream `chunks(outputs)` as SSE or return `whole(finals)`."""
        if len(prompts) > self.max_pending:
            raise OpenAIError(400, f"prompt holds {len(prompts)} prompts; at most {self.max_pending} per request",
                              param="prompt")
        token = self._admit(len(prompts))
        # Engine ids are unique even when a client reuses its request_id (it stays the response id).
        suffix = uuid.uuid4().hex[:8]
        gens = [self._timed(p, pp, f"{request_id}-{i}-{suffix}") for i, (p, pp) in enumerate(zip(prompts, params))]
        if stream:
            body = self._sse(gens, chunks, token)
            # A client gone before the body starts leaves the generator unstarted (its finally
            # never runs); its admission is then returned when the generator is collected.
            weakref.finalize(body, self._release, token)
            return StreamingResponse(body, media_type="text/event-stream")
        try:
            finals: list[RequestOutput | None] = [None] * len(prompts)
            async for i, out in _merge(gens):
                finals[i] = out
            return JSONResponse(whole(finals))
        except Exception as e:
            raise self._error(e) from e
        finally:
            self._release(token)

    async def _sse(self, gens, chunks, token) -> AsyncIterator[str]:
        try:
            async for piece in chunks(_merge(gens)):
                yield fmt.sse(piece)
        except Exception as e:
            err = self._error(e)
            yield fmt.sse(fmt.error_body(err.message, err.type, None, err.status))
        finally:
            self._release(token)
        yield fmt.sse("[DONE]")

    # ---- routes ---------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
        try:
            replicas = await self.coordinator.replicas.remote()
        except Exception as e:  # the coordinator restarting: not healthy yet
            raise _overloaded(f"coordinator unavailable: {type(e).__name__}") from e
        roles = {r["role"] for r in replicas}
        needed = {"prefill", "decode"} if self.mode == "pd" else {"colocated"}
        if not needed <= roles:
            raise _overloaded(f"no live replica yet for {sorted(needed - roles)}")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "pdserve",
            "root": self.model_dir, "parent": None, "max_model_len": self.processor.max_model_len,
        }]}

    @app.get("/metrics")
    async def metrics(self) -> Response:
        replicas = await self.coordinator.replicas.remote()
        return Response(self.metrics.render(replicas), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/status")
    async def status(self) -> dict:
        return await self.coordinator.status.remote()

    @app.post("/scale")
    async def scale(self, request: Request) -> JSONResponse:
        """`{"prefill": N, "decode": M}` -> 202 with the target (the Coordinator decides)."""
        try:
            body = await request.json()
        except ValueError as e:
            raise OpenAIError(400, f"malformed JSON body: {e}") from e
        code, payload = await self.coordinator.scale.remote(body)
        return JSONResponse(payload, status_code=code)

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest) -> Response:
        self._check_model(body.model)
        if (bad := body.unsupported()) is not None:
            raise OpenAIError(400, bad[1], param=bad[0])
        try:
            params = body.sampling_params(body.max_tokens, body.logprobs)
        except ValueError as e:
            raise _bad_request(e) from e
        prompts, per_prompt = [], []
        if not body.prompts():
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        for p in body.prompts():
            if isinstance(p, str):
                ids = self.tokenizer.encode(p, add_special_tokens=True)
            else:
                ids = list(p)
            per_prompt.append(self._validate(ids, params, "prompt"))  # token ids range-checked here
            text = p if isinstance(p, str) else self.tokenizer.decode(ids)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        request_id = body.request_id or f"cmpl-{uuid.uuid4().hex}"
        n_logprobs = body.logprobs
        echo = body.echo

        def choice(i, out: RequestOutput, text: str, ids: list[int], positions, offset: int, finish) -> dict:
            lp = (fmt.completion_logprobs(self.text_of, ids, positions or [], n_logprobs, offset)
                  if n_logprobs is not None else None)
            c = out.outputs[0]
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish,
                    "stop_reason": c.stop_reason if finish else None}

        def whole(finals):
            choices, n_prompt, n_gen = [], 0, 0
            for i, out in enumerate(finals):
                c = out.outputs[0]
                prefix = prompts[i]["prompt"] if echo else ""
                choices.append(choice(i, out, prefix + c.text, c.token_ids, c.logprobs, len(prefix),
                                      c.finish_reason))
                n_prompt += len(out.prompt_token_ids)
                n_gen += len(c.token_ids)
            return fmt.response_object("text_completion", request_id, self.model_name, choices, fmt.usage(n_prompt, n_gen))

        async def chunks(merged):
            offsets = [0] * len(prompts)
            counts = [[len(p["prompt_token_ids"]), 0] for p in prompts]
            if echo:
                for i, p in enumerate(prompts):
                    offsets[i] = len(p["prompt"])
                    yield fmt.response_object("text_completion", request_id, self.model_name, [
                        {"index": i, "text": p["prompt"], "logprobs": None, "finish_reason": None}], None, True)
            async for i, out in merged:
                c = out.outputs[0]
                counts[i][1] = len(c.token_ids)
                finish = c.finish_reason if out.finished else None
                if not out.delta_text and not out.delta_token_ids and finish is None:
                    continue
                ch = choice(i, out, out.delta_text, out.delta_token_ids, out.delta_logprobs, offsets[i], finish)
                offsets[i] += len(out.delta_text)
                u = fmt.usage(*counts[i]) if body.continuous_usage else None
                yield fmt.response_object("text_completion", request_id, self.model_name, [ch], u, True)
            if body.include_usage:
                yield fmt.response_object("text_completion", request_id, self.model_name, [], fmt.usage(
                    sum(c[0] for c in counts), sum(c[1] for c in counts)), True)

        return await self._respond(prompts, per_prompt, request_id, body.stream, chunks, whole)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest) -> Response:
        self._check_model(body.model)
        if (bad := body.unsupported()) is not None:
            raise OpenAIError(400, bad[1], param=bad[0])
        try:
            params = body.sampling_params(body.max_new_tokens, body.num_logprobs)
        except ValueError as e:
            raise _bad_request(e, "messages", "top_logprobs") from e
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError(400, "this model has no chat template; use /v1/completions", param="messages")
        try:
            text = self.tokenizer.apply_chat_template(
                body.conversation(), tokenize=False,
                add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                continue_final_message=body.continue_final_message)
        except Exception as e:  # template errors are the caller's messages' fault
            raise OpenAIError(400, f"could not apply the chat template: {e}", param="messages") from e
        ids = self.tokenizer.encode(text, add_special_tokens=False)  # the template has its specials
        params = self._validate(ids, params, "messages", "top_logprobs")
        prompt = {"prompt": text, "prompt_token_ids": ids}
        request_id = body.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        n_logprobs = body.num_logprobs

        def logprobs(ids, positions):
            return fmt.chat_logprobs(self.text_of, ids, positions or [], n_logprobs) if n_logprobs is not None else None

        def whole(finals):
            out = finals[0]
            c = out.outputs[0]
            choices = [{"index": 0, "message": {"role": "assistant", "content": c.text},
                        "logprobs": logprobs(c.token_ids, c.logprobs), "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason}]
            return fmt.response_object("chat.completion", request_id, self.model_name, choices,
                                   fmt.usage(len(out.prompt_token_ids), len(c.token_ids)))

        async def chunks(merged):
            n_gen = 0
            yield fmt.response_object("chat.completion", request_id, self.model_name, [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}], None, True)
            async for _, out in merged:
                c = out.outputs[0]
                n_gen = len(c.token_ids)
                finish = c.finish_reason if out.finished else None
                if not out.delta_text and not out.delta_token_ids and finish is None:
                    continue
                delta = {"content": out.delta_text} if out.delta_text or finish is None else {}
                u = fmt.usage(len(ids), n_gen) if body.continuous_usage else None
                yield fmt.response_object("chat.completion", request_id, self.model_name, [
                    {"index": 0, "delta": delta, "logprobs": logprobs(out.delta_token_ids, out.delta_logprobs),
                     "finish_reason": finish}], u, True)
            if body.include_usage:
                yield fmt.response_object("chat.completion", request_id, self.model_name, [], fmt.usage(len(ids), n_gen), True)

        return await self._respond([prompt], [params], request_id, body.stream, chunks, whole)
