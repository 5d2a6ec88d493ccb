"""OpenAI's (and vLLM's) response bodies as pydantic models: chat and completions, whole and
streamed, usage, logprobs, errors, the model list and the tokenizer routes' answers.

The JSON of each is what the wire carries: a model is serialized whole (no `exclude_unset`:
cluster.http.openai_format.to_json), so which fields a body holds is stated here, once. A field
OpenAI leaves out when it has no value (a chunk's `usage` without `include_usage`, a message's
`tool_calls`, a delta's unset parts, vLLM's `prompt_logprobs` unless asked for) is `absent()`;
every other field is always sent, null included. The builders (cluster.http.chat,
cluster.http.completions, cluster.http.openai_format) fill them from engine outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

M = TypeVar("M", bound=BaseModel)


def _is_none(value) -> bool:
    return value is None


def absent(**kwargs):
    """A field left out of the JSON while None (OpenAI sends no key, not a null)."""
    return Field(None, exclude_if=_is_none, **kwargs)


def builder(model: type[M]) -> Callable[[dict], M]:
    """`model` made from plain values (dicts for its nested models), checked in one validator
    call. For what is built per token, a stream's chunks: a constructor per nested model costs
    a call each and `model_validate` adds a Python wrapper. Per chat chunk, with to_json: 3.8 us
    this way, 5.5 us by nested constructors, 4.1 us for the dicts and json.dumps before these
    models (docs/benchmarks.md#server-cpu-per-output-token)."""
    return model.__pydantic_validator__.validate_python


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV was found, not computed (prefix cache)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # vLLM's --enable-prompt-tokens-details: absent unless the server asks for it.
    prompt_tokens_details: PromptTokensDetails | None = absent()

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> Usage:
        """`cached_tokens`: None leaves prompt_tokens_details out."""
        details = None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


# ---- errors -------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    # Extra keys are a refused scale's `needed` and `free` (cluster.http.control_answers).
    model_config = ConfigDict(extra="allow")

    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """Every error body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo

    @classmethod
    def of(cls, message: str, type_: str, param: str | None = None, code: str | int | None = None,
           **details) -> ErrorResponse:
        return cls(error=ErrorInfo(message=message, type=type_, param=param, code=code, **details))


# ---- logprobs -----------------------------------------------------------------------------------
class TopLogprob(BaseModel):
    token: str
    logprob: float | None
    bytes: list[int]


class ChatLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry]


class CompletionLogprobs(BaseModel):
    """The legacy completions `logprobs`: one entry per token in each list; an echoed prompt's
    first token has null logprobs."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's `prompt_logprobs` entry of one token at one position."""

    logprob: float
    rank: int | None
    decoded_token: str | None


# Per prompt position: None (the first) or {token id as a string: its entry}.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


# ---- chat ---------------------------------------------------------------------------------------
class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    # vLLM's: a reasoning model's thinking (--reasoning-parser); absent without a parser.
    reasoning_content: str | None = absent()
    content: str | None
    tool_calls: list[ToolCall] | None = absent()


class ChatChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None  # vLLM's: the stop string or token id that ended it


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = absent()  # vLLM's, beside the choices


class DeltaFunctionCall(BaseModel):
    name: str | None = absent()
    arguments: str | None = absent()


class DeltaToolCall(BaseModel):
    """A piece of call `index`: the first carries its id, type and name, later ones fragments
    of its arguments."""

    index: int
    id: str | None = absent()
    type: Literal["function"] | None = absent()
    function: DeltaFunctionCall | None = absent()


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = absent()
    reasoning_content: str | None = absent()
    content: str | None = absent()
    tool_calls: list[DeltaToolCall] | None = absent()


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = absent()  # with include_usage (the last chunk) or continuous usage


# ---- completions --------------------------------------------------------------------------------
class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = absent()  # vLLM's; in a stream, the first chunk only


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    """One streamed piece of a completion: OpenAI names it `text_completion` as the whole one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = absent()


# ---- models and tokenizer routes ------------------------------------------------------------------
class ModelCard(BaseModel):
    """One /v1/models entry, with vLLM's fields: `root` the weights' path, `parent` the base
    model of an adapter."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    root: str
    parent: str | None
    max_model_len: int | None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """The tokenizer's configuration as loaded: its keys vary with the tokenizer."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
