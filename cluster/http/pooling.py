"""The pooling routes' jobs: `POST /v1/embeddings`, `/v1/score`, `/rerank` and `/v1/rerank`
(docs/pooling.md#endpoints). Each input is one pooling EngineRequest (prefill only), built
and checked here as the engine will check it, so bad input is a 400 naming its field; the
ingress runs them as any job's requests (in P/D on a Prefill replica: cluster.http.runner)."""

from __future__ import annotations

import base64
import time
import uuid

import numpy as np

from cluster.http.errors import OpenAIError, rejecting
from cluster.http.pooling_models import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from cluster.http.served_model import Job, ServedModel
from engine.engine_request import EngineRequest
from engine.errors import ParameterError
from engine.outputs import RequestOutput
from engine.pooling.outputs import score_inputs
from engine.pooling.params import PoolingParams
from engine.sampling_params import SamplingParams

ENCODING_FORMATS = ("float", "base64")
_ONE_STEP = SamplingParams(max_tokens=1)  # a pooling request never samples (engine.processor)


def _pooling_task(served: ServedModel, model: str, task: str | None, route: str) -> str:
    """The served pooling model's task; a 400 unless it is `task` (None: any)."""
    if served.check_model(model) is not None:
        raise OpenAIError(400, f"{route}: LoRA adapters do not apply to pooling requests; name the base model "
                          f"`{served.model_name}`", param="model")
    pooling = served.processor.pooling
    if pooling is None:
        raise OpenAIError(400, f"{route}: the model `{served.model_name}` generates text; it is not a pooling "
                          "model (serve one with --runner pooling)", param="model", code="model_not_supported")
    if task is not None and pooling.task != task:
        raise OpenAIError(400, f"{route}: the model `{served.model_name}` is a pooling model for "
                          f"{pooling.task}, not embeddings (--convert embed)", param="model",
                          code="model_not_supported")
    return pooling.task


def _request(served: ServedModel, prompt, params: PoolingParams, priority: int) -> EngineRequest:
    if priority and not served.priority_scheduling:
        raise ParameterError("priority", "priority must be 0 unless the server runs with --scheduling-policy priority")
    return served.processor.process(prompt if isinstance(prompt, (str, dict)) else {"prompt_token_ids": prompt},
                                    _ONE_STEP, priority=priority, pooling_params=params)


def _usage(finals: list[RequestOutput]) -> PoolingUsage:
    n = sum(len(out.prompt_token_ids) for out in finals)
    return PoolingUsage(prompt_tokens=n, total_tokens=n)


def _no_stream(_):
    raise AssertionError("pooling jobs are not streamed")


def embedding_job(served: ServedModel, body: EmbeddingRequest) -> Job:
    _pooling_task(served, body.model, "embed", "/v1/embeddings")
    with rejecting(body):
        if body.encoding_format not in ENCODING_FORMATS:
            raise ParameterError("encoding_format", f"encoding_format must be one of {ENCODING_FORMATS}, "
                                 f"got {body.encoding_format!r}")
        params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
        inputs = body.inputs()
        if len(inputs) > served.max_prompts:
            raise ParameterError("prompt", f"input holds {len(inputs)} items; at most {served.max_prompts}")
        requests = [_request(served, x, params, body.priority) for x in inputs]
    request_id = body.request_id or f"embd-{uuid.uuid4().hex}"
    as_base64 = body.encoding_format == "base64"

    def whole(finals: list[RequestOutput]) -> EmbeddingResponse:
        data = []
        for i, out in enumerate(finals):
            vec = out.pooled.float()
            value = base64.b64encode(vec.numpy().astype("<f4").tobytes()).decode() if as_base64 else vec.tolist()
            data.append(EmbeddingData(index=i, embedding=value))
        return EmbeddingResponse(id=request_id, created=int(time.time()), model=body.model, data=data,
                                 usage=_usage(finals))

    return Job(requests, request_id, False, _no_stream, whole)


def _pair_requests(served: ServedModel, body, task: str, firsts: list[str], seconds: list[str]):
    """(the requests, their pooled outputs -> each pair's score): engine.pooling.outputs.score_inputs."""
    prompts, scores = score_inputs(served.tokenizer, task, firsts, seconds)
    if len(prompts) > served.max_prompts:
        raise ParameterError("prompt", f"the request holds {len(seconds)} pairs ({len(prompts)} inputs); at most "
                             f"{served.max_prompts} inputs")
    return [_request(served, p, PoolingParams(), body.priority) for p in prompts], scores


def score_job(served: ServedModel, body: ScoreRequest) -> Job:
    task = _pooling_task(served, body.model, None, "/v1/score")
    with rejecting(body):
        firsts, seconds = body.texts()
        if not seconds or len(firsts) not in (1, len(seconds)):
            raise ParameterError("prompt", "text_2 must hold at least one text, and text_1 one text or as many as "
                                 "text_2")
        requests, scores = _pair_requests(served, body, task, firsts, seconds)
    request_id = body.request_id or f"score-{uuid.uuid4().hex}"

    def whole(finals: list[RequestOutput]) -> ScoreResponse:
        data = [ScoreData(index=i, score=s) for i, s in enumerate(scores([out.pooled for out in finals]))]
        return ScoreResponse(id=request_id, created=int(time.time()), model=body.model, data=data,
                             usage=_usage(finals))

    return Job(requests, request_id, False, _no_stream, whole)


def rerank_job(served: ServedModel, body: RerankRequest) -> Job:
    task = _pooling_task(served, body.model, None, "/rerank")
    with rejecting(body):
        if not body.documents:
            raise ParameterError("prompt", "documents must hold at least one document")
        if body.top_n is not None and body.top_n < 0:
            raise ParameterError("top_n", f"top_n must be >= 0 (0: every document), got {body.top_n}")
        requests, scores_of = _pair_requests(served, body, task, [body.query], body.documents)
    request_id = body.request_id or f"rerank-{uuid.uuid4().hex}"
    top_n = body.top_n or len(body.documents)

    def whole(finals: list[RequestOutput]) -> RerankResponse:
        scores = np.array(scores_of([out.pooled for out in finals]))
        order = np.argsort(-scores, kind="stable")[:top_n]  # ties keep the documents' order
        results = [RerankResult(index=int(i), relevance_score=float(scores[i]),
                                document=RerankDocument(text=body.documents[i]) if body.return_documents else None)
                   for i in order]
        return RerankResponse(id=request_id, model=body.model, results=results, usage=_usage(finals))

    return Job(requests, request_id, False, _no_stream, whole)
