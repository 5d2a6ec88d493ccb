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


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """A reasoning model's thinking (--reasoning-parser), before the answer's items."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    status: ItemStatus
    summary: list = []
    content: list[ReasoningText]


OutputItem = Annotated[OutputMessage | FunctionToolCall | ReasoningItem, Field(discriminator="type")]


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


# ---- the stream's events: each has the next sequence_number; an added and a done event (or
# the four that carry the Response) differ only in their `type` -------------------------------
class _Event(BaseModel):
    type: str
    sequence_number: int


class _ResponseEvent(_Event):
    response: Response


class ResponseCreated(_ResponseEvent):
    type: Literal["response.created"] = "response.created"


class ResponseInProgress(_ResponseEvent):
    type: Literal["response.in_progress"] = "response.in_progress"


class ResponseCompleted(_ResponseEvent):
    type: Literal["response.completed"] = "response.completed"


class ResponseIncomplete(_ResponseEvent):
    type: Literal["response.incomplete"] = "response.incomplete"


class _ItemEvent(_Event):
    output_index: int
    item: OutputItem


class OutputItemAdded(_ItemEvent):
    type: Literal["response.output_item.added"] = "response.output_item.added"


class OutputItemDone(_ItemEvent):
    type: Literal["response.output_item.done"] = "response.output_item.done"


class _InItemEvent(_Event):
    """An event about the content of the item at `output_index`."""

    item_id: str
    output_index: int


class _PartEvent(_InItemEvent):
    content_index: int
    part: OutputText


class ContentPartAdded(_PartEvent):
    type: Literal["response.content_part.added"] = "response.content_part.added"


class ContentPartDone(_PartEvent):
    type: Literal["response.content_part.done"] = "response.content_part.done"


class OutputTextDelta(_InItemEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    content_index: int
    delta: str
    logprobs: list = []


class OutputTextDone(_InItemEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    content_index: int
    text: str
    logprobs: list = []


class FunctionCallArgumentsDelta(_InItemEvent):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    delta: str


class FunctionCallArgumentsDone(_InItemEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    arguments: str


class ReasoningTextDelta(_InItemEvent):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    content_index: int
    delta: str


class ReasoningTextDone(_InItemEvent):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    content_index: int
    text: str


class ErrorEvent(_Event):
    """What ends a stream whose request failed (no `data: [DONE]` follows)."""

    type: Literal["error"] = "error"
    code: str | int | None
    message: str
    param: str | None = None


ResponseEvent = (ResponseCreated | ResponseInProgress | ResponseCompleted | ResponseIncomplete | OutputItemAdded
                 | OutputItemDone | ContentPartAdded | ContentPartDone | OutputTextDelta | OutputTextDone
                 | FunctionCallArgumentsDelta | FunctionCallArgumentsDone | ReasoningTextDelta | ReasoningTextDone
                 | ErrorEvent)
