"""The Responses API's answer as pydantic models: the Response object, its output items and
usage, and the typed events of its stream, in OpenAI's shapes (the openai SDK parses them into
its own models). Built by cluster.http.responses_answer; serialized with `model_dump_json()`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = []


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionToolCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    status: ItemStatus
    call_id: str
    name: str
    arguments: str  # a JSON object, as a string


OutputItem = Annotated[OutputMessage | FunctionToolCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class Response(BaseModel):
    """A Response: what was generated, then the request's settings as OpenAI echoes them
    (cluster.http.responses.ResponsesRequest.echo)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    output: list[OutputItem]
    usage: ResponseUsage | None
    error: None = None  # a failed request is an HTTP error or an `error` event, never a Response
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    tools: list[dict]
    tool_choice: str | dict
    text: dict
    user: str | None
    previous_response_id: None = None
    store: bool = False
    background: bool = False
    truncation: Literal["disabled"] = "disabled"
    reasoning: None = None


# ---- the stream's events: each has the next sequence_number ---------------------------------------
class ResponseCreated(BaseModel):
    type: Literal["response.created"] = "response.created"
    sequence_number: int
    response: Response


class ResponseInProgress(BaseModel):
    type: Literal["response.in_progress"] = "response.in_progress"
    sequence_number: int
    response: Response


class ResponseCompleted(BaseModel):
    type: Literal["response.completed"] = "response.completed"
    sequence_number: int
    response: Response


class ResponseIncomplete(BaseModel):
    type: Literal["response.incomplete"] = "response.incomplete"
    sequence_number: int
    response: Response


class OutputItemAdded(BaseModel):
    type: Literal["response.output_item.added"] = "response.output_item.added"
    sequence_number: int
    output_index: int
    item: OutputItem


class OutputItemDone(BaseModel):
    type: Literal["response.output_item.done"] = "response.output_item.done"
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartAdded(BaseModel):
    type: Literal["response.content_part.added"] = "response.content_part.added"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDone(BaseModel):
    type: Literal["response.content_part.done"] = "response.content_part.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDelta(BaseModel):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list = []


class OutputTextDone(BaseModel):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list = []


class FunctionCallArgumentsDelta(BaseModel):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(BaseModel):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    sequence_number: int
    item_id: str
    output_index: int
    arguments: str


class ErrorEvent(BaseModel):
    """What ends a stream whose request failed (no `data: [DONE]` follows)."""

    type: Literal["error"] = "error"
    sequence_number: int
    code: str | int | None
    message: str
    param: str | None = None


ResponseEvent = (ResponseCreated | ResponseInProgress | ResponseCompleted | ResponseIncomplete | OutputItemAdded
                 | OutputItemDone | ContentPartAdded | ContentPartDone | OutputTextDelta | OutputTextDone
                 | FunctionCallArgumentsDelta | FunctionCallArgumentsDone | ErrorEvent)
