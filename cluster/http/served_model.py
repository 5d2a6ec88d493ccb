"""What a route needs to turn an OpenAI body into engine requests, and what it hands back.

`ServedModel` is the model's side of the ingress: its served name, tokenizer and input processor,
which turns each prompt into the EngineRequest every engine runs as it is (a bad one is a 400
before any replica sees it). A route (cluster.http.chat, cluster.http.completions) builds a `Job` from
it; the ingress admits and runs the job and answers with its `whole` or `chunks`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pydantic import BaseModel

from cluster.http import openai_format as fmt
from cluster.http.errors import OpenAIError
from cluster.http.lora import LoRARegistry
from cluster.http.openai_models import ErrorResponse
from cluster.http.request_limits import RequestLimits
from engine.engine_request import EngineRequest
from engine.errors import ParameterError
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.processor import InputProcessor
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ServedModel:
    model_name: str  # what clients put in `model`
    model_dir: str
    tokenizer: object
    processor: InputProcessor
    text_of: fmt.TokenText  # per-token strings for logprobs (cached)
    allowed_local_media_path: str | None = None  # where file:// images may come from
    tool_parser: type | None = None  # the tool-call parser class (cluster.http.tool_parsers)
    enable_auto_tool_choice: bool = False
    reasoning_parser: object | None = None  # cluster.http.reasoning.ReasoningParser (--reasoning-parser)
    loras: LoRARegistry | None = None  # the served LoRA adapters (enable_lora), by name
    limits: RequestLimits = RequestLimits()  # the lists and sizes a body may carry
    max_prompts: int = 1024  # sequences per request (--max-pending-requests)
    prompt_tokens_details: bool = False  # usage.prompt_tokens_details (--enable-prompt-tokens-details)
    priority_scheduling: bool = False  # the engines order their queues by `priority` (--scheduling-policy)
    # Schemas without additionalProperties allow no other key (--structured-outputs-config).
    strict_schemas: bool = True

    def check_model(self, model: str) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for any other name."""
        if self.loras is not None:
            return self.loras.resolve(model)
        if model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist. Available: `{self.model_name}`.",
                              "not_found_error", param="model", code="model_not_found")
        return None

    def check_limits(self, body) -> None:
        """A ParameterError naming the first list or size of `body` past its bound, before any
        per-item work (cluster.http.request_limits)."""
        self.limits.check(body, self.processor.vocab_size, self.max_prompts)

    def request(self, ids: list[int], params: SamplingParams, text: str | None = None, images: list | None = None,
                lora: LoRARequest | None = None, priority: int = 0, cache_salt: str | None = None) -> EngineRequest:
        """The EngineRequest of one prompt, built here once for every engine it will meet:
        checked exactly as the engine checks it (a ParameterError otherwise), image
        placeholders expanded, and an unset max_tokens resolved by the one rule (the room left
        in the context). Its id is the ingress's to set when it runs."""
        if priority and not self.priority_scheduling:
            # vLLM's rule: a priority the engines would ignore is the user's mistake, said now.
            raise ParameterError("priority", "priority must be 0 unless the server runs with "
                                 "--scheduling-policy priority")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ParameterError("cache_salt", "cache_salt must be a non-empty string")
        prompt: dict = {"prompt_token_ids": ids, "prompt": text}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        return self.processor.process(prompt, params, lora_request=lora, priority=priority, cache_salt=cache_salt)


def _error_body(err: OpenAIError) -> ErrorResponse:
    return ErrorResponse.of(err.message, err.type, None, err.status)


@dataclass(frozen=True)
class SSEFormat:
    """How a Job's stream goes on the wire: each piece from `chunks` and the piece that reports
    a failure mid-stream, as SSE text, and whether `data: [DONE]` ends it. The default is chat's
    and completions' (OpenAI's `data:` lines); the Responses route names each event instead."""

    piece: Callable[[BaseModel], str] = fmt.sse
    failure: Callable[[OpenAIError], BaseModel] = _error_body
    done: bool = True


DATA_LINES = SSEFormat()


@dataclass(frozen=True)
class Job:
    """One HTTP request's engine requests and how to answer it. With `n` > 1 the list holds
    each prompt n times in a row (its parallel samples, each with its own params:
    engine.parallel_sampling), so output g is choice `index` g."""

    requests: list[EngineRequest]
    request_id: str  # the response's id
    stream: bool
    # SSE: the response objects (cluster.http.openai_models) for the merged (index, output)
    # stream of every request.
    chunks: Callable[[AsyncIterator[tuple[int, RequestOutput]]], AsyncIterator[BaseModel]]
    whole: Callable[[list[RequestOutput]], BaseModel]  # the response object from every final output
    n: int = 1
    sse: SSEFormat = DATA_LINES
