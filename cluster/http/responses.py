"""`POST /v1/responses`: OpenAI's Responses API, stateless, as an adapter over the chat route.

The request becomes a chat request (input items as messages, function tools as chat tools,
`text.format` as `response_format`) and runs as chat_job's Job, so there is one engine path and
one set of checks; the answer is chat's, rewritten (cluster.http.responses_answer). Nothing is
stored: a field that needs storage is a 400 naming it.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from cluster.http.chat import chat_job
from cluster.http.errors import OpenAIError
from cluster.http.protocol import ChatCompletionRequest
from cluster.http.responses_answer import Shell, adapt
from cluster.http.served_model import Job, ServedModel

# A chat `param` and the Responses field it came from (one starting "messages" is `input`).
_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields are ignored, as OpenAI's server does


class TextPart(_Body):
    type: Literal["input_text", "output_text"]
    text: str


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


def _item_type(item) -> str | None:
    """A message may leave out its `type`."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")], Discriminator(_item_type)]


class FunctionTool(_Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class FormatPlain(_Body):
    type: Literal["text", "json_object"]


class FormatJSONSchema(_Body):
    type: Literal["json_schema"]
    name: str
    schema_: dict = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Body):
    format: Annotated[FormatPlain | FormatJSONSchema, Field(discriminator="type")] | None = None


class ResponsesRequest(_Body):
    """The fields pdserve answers; others OpenAI defines that need storage or a feature pdserve
    lacks are declared to be refused, the rest (`reasoning`, `truncation`, ...) are ignored."""

    model: str
    input: list[InputItem] | str
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    priority: int = 0  # vLLM's: with --scheduling-policy priority, lower runs first
    # Refused when set: nothing is stored or run in the background, and there are no logprobs.
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None
    background: bool | None = None
    include: list[str] | None = None

    def check_supported(self) -> None:
        """An OpenAIError (400) naming the first field set to something pdserve cannot do."""
        stored = "responses are not stored (pdserve's Responses API is stateless)"
        refused = [("store", self.store, f"store must be false or absent: {stored}"),
                   ("previous_response_id", self.previous_response_id,
                    f"previous_response_id is not supported: {stored}; send the earlier items in `input`"),
                   ("conversation", self.conversation, f"conversation is not supported: {stored}"),
                   ("prompt", self.prompt, f"prompt (a stored prompt template) is not supported: {stored}"),
                   ("background", self.background, "background must be false or absent: responses are "
                    "answered in the request"),
                   ("include", "message.output_text.logprobs" in (self.include or ()),
                    "include: message.output_text.logprobs is not supported (no logprobs on /v1/responses)")]
        for param, value, message in refused:
            if value:
                raise OpenAIError(400, message, param=param)

    def function_tools(self) -> list[FunctionTool]:
        tools = []
        for i, t in enumerate(self.tools or ()):
            if t.get("type") != "function":
                raise OpenAIError(400, f"tools[{i}] has type {t.get('type')!r}: only function tools "
                                  "are supported", param="tools")
            try:
                tools.append(FunctionTool.model_validate(t))
            except ValidationError as e:
                raise OpenAIError(400, f"tools[{i}] is not a function tool: {e.errors()[0]['msg']} "
                                  f"at {'.'.join(map(str, e.errors()[0]['loc']))}", param="tools") from None
        return tools

    def messages(self) -> list[dict]:
        """The conversation as chat messages: `instructions` first (system), then each input
        item. A function_call joins the assistant message right before it (its text or the
        calls made with it), as chat shows one assistant turn."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant":
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
            else:
                out.append({"role": item.role, "content": _text(item.content)})
        if not out:
            raise OpenAIError(400, "input holds no item (and there are no instructions)", param="input")
        return out

    def chat_body(self, response_id: str) -> dict:
        """The chat request (a ChatCompletionRequest's JSON) that answers this one."""
        body = {"model": self.model, "messages": self.messages(), "request_id": response_id,
                "max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "user": self.user, "stream": bool(self.stream), "priority": self.priority}
        if self.stream:
            body["stream_options"] = {"include_usage": True}  # the final response's usage
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.function_tools()]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        fmt_ = self.text.format if self.text is not None else None
        if isinstance(fmt_, FormatJSONSchema):
            spec = {"name": fmt_.name, "schema": fmt_.schema_, "description": fmt_.description, "strict": fmt_.strict}
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {k: v for k, v in spec.items() if v is not None}}
        elif fmt_ is not None:
            body["response_format"] = {"type": fmt_.type}
        return body

    def echo(self) -> dict:
        """The request's settings as the Response object reports them (OpenAI's defaults filled in)."""
        fmt_ = self.text.format if self.text is not None else None
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata or {},
                "parallel_tool_calls": self.parallel_tool_calls is not False,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p,
                "tools": [t.model_dump(exclude_none=True) for t in self.function_tools()],
                "tool_choice": (self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedFunction)
                                else self.tool_choice or "auto"),
                "text": {"format": fmt_.model_dump(by_alias=True, exclude_none=True) if fmt_ else {"type": "text"}},
                "user": self.user, "previous_response_id": None, "store": False, "background": False,
                "truncation": "disabled", "reasoning": None}


def responses_job(served: ServedModel, body: ResponsesRequest) -> Job:
    """The chat route's Job for this request, answering in the Responses API's shapes."""
    body.check_supported()
    if body.tools is not None and len(body.tools) > served.limits.max_tools:  # before each is parsed
        raise OpenAIError(400, f"tools has {len(body.tools)} entries; at most {served.limits.max_tools} are "
                          "accepted (--max-tools)", param="tools")
    response_id = f"resp_{uuid.uuid4().hex}"
    chat_request = ChatCompletionRequest.model_validate(body.chat_body(response_id))
    try:
        chat = chat_job(served, chat_request, cached_details=True)  # input_tokens_details needs it
    except OpenAIError as e:  # chat's `param` is a chat field: name the one this request sent
        param = "input" if (e.param or "").startswith("messages") else _PARAMS.get(e.param, e.param)
        raise OpenAIError(e.status, e.message, e.type, param, e.code, e.headers) from e
    return adapt(chat, Shell(response_id, int(time.time()), chat_request.model, body.echo()))
