"""`POST /v1/messages`: Anthropic's Messages API, as an adapter over the chat route (as vLLM and
Ray Serve LLM serve it, so Anthropic-SDK clients run on open models; docs/tools.md#anthropic).

The request becomes a chat request (system and messages, content blocks, tools and
tool_choice, stop_sequences) and runs as chat_job's Job: one engine path, one set of checks;
the answer is chat's, rewritten into a Message or the Messages stream's events
(cluster.http.anthropic_answer). Fields that change nothing here (`metadata`, `service_tier`)
are ignored; extended `thinking` is refused by name.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cluster.http.anthropic_answer import adapt
from cluster.http.chat import chat_job, render, template_kwargs
from cluster.http.errors import OpenAIError
from cluster.http.protocol import ChatCompletionRequest
from cluster.http.served_model import Job, ServedModel


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Body):
    type: Literal["text"]
    text: str


# The image types Anthropic's API takes in a base64 source.
MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


class ImageSource(_Body):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None

    def chat_url(self, where: str) -> str:
        """The chat image part's URL: a data URL of a base64 source, a url source's own URL
        (data: and file:// as chat takes them). `where`: this source's path in the request,
        named by the 400 a malformed source gets."""
        if self.type == "url":
            if not self.url:
                raise OpenAIError(400, f"{where}.url: a url image source needs a url", param=f"{where}.url")
            return self.url
        if self.media_type not in MEDIA_TYPES:
            raise OpenAIError(400, f"{where}.media_type must be one of {', '.join(MEDIA_TYPES)}, got "
                              f"{self.media_type!r}", param=f"{where}.media_type")
        if not self.data:
            raise OpenAIError(400, f"{where}.data: a base64 image source needs its data",
                              param=f"{where}.data")
        return f"data:{self.media_type};base64,{self.data}"

    def field(self) -> str:
        """The source field that carries the image (what a decoding error names)."""
        return "url" if self.type == "url" else "data"


class ImageBlock(_Body):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Body):
    name: str
    description: str | None = None
    input_schema: dict


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(_Body):
    model: str
    max_tokens: int | None = None  # required by /v1/messages, not by count_tokens
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict | None = None

    def conversation(self) -> list[dict]:
        """The chat messages: the system prompt first; a user turn's tool results as `tool`
        messages (before its text, as they answer the turn before); an assistant turn's
        tool_use blocks as its tool_calls."""
        system = self.system if isinstance(self.system, str) or self.system is None else "".join(
            b.text for b in self.system)
        out = [{"role": "system", "content": system}] if system else []
        for i, m in enumerate(self.messages):
            blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
            if m.role == "assistant":
                text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
                calls = [{"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                         for b in blocks if isinstance(b, ToolUseBlock)]
                out.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
                continue
            out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                    for b in blocks if isinstance(b, ToolResultBlock)]
            parts = [{"type": "text", "text": b.text} if isinstance(b, TextBlock)
                     else {"type": "image_url",
                           "image_url": {"url": b.source.chat_url(f"messages[{i}].content[{j}].source")}}
                     for j, b in enumerate(blocks) if isinstance(b, TextBlock | ImageBlock)]
            if any(isinstance(b, ToolUseBlock) for b in blocks):
                raise OpenAIError(400, f"messages[{i}]: a user turn cannot hold tool_use blocks", param="messages")
            if parts:
                only_text = all(p["type"] == "text" for p in parts)
                out.append({"role": "user", "content": "".join(p["text"] for p in parts) if only_text else parts})
        return out

    def image_fields(self) -> list[str]:
        """The path of each image block's data (or url), in conversation order: the order of
        the chat request's image parts, so chat's k-th image error is about the k-th of these."""
        return [f"messages[{i}].content[{j}].source.{b.source.field()}"
                for i, m in enumerate(self.messages) if m.role == "user" and isinstance(m.content, list)
                for j, b in enumerate(m.content) if isinstance(b, ImageBlock)]

    def chat_body(self, message_id: str) -> dict:
        if self.thinking is not None and self.thinking.get("type") not in (None, "disabled"):
            raise OpenAIError(400, "thinking (extended thinking) is not supported; a reasoning model's thinking "
                              "comes back as text with --reasoning-parser off", param="thinking")
        body = {"model": self.model, "messages": self.conversation(), "request_id": message_id,
                "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "stop": self.stop_sequences, "stream": bool(self.stream)}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                               **({"description": t.description}
                                                                  if t.description else {})}}
                             for t in self.tools]
        choice = self.tool_choice
        if choice is not None and (self.tools or choice.type == "none"):
            if choice.type == "tool":
                if not choice.name:
                    raise OpenAIError(400, 'tool_choice of type "tool" needs a name', param="tool_choice")
                body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        return body


def _chat_request(body: MessagesRequest, message_id: str, **fields) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate({**body.chat_body(message_id), **fields})
    except ValidationError as e:  # what the conversion left (e.g. no message with content)
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise OpenAIError(400, f"invalid request: {where}: {err.get('msg')}", param="messages") from None


def messages_job(served: ServedModel, body: MessagesRequest) -> Job:
    if body.max_tokens is None or body.max_tokens < 1:
        raise OpenAIError(400, f"max_tokens is required and must be >= 1, got {body.max_tokens}", param="max_tokens")
    message_id = f"msg_{uuid.uuid4().hex}"
    chat_request = _chat_request(body, message_id)
    try:
        chat = chat_job(served, chat_request, cached_details=True)
    except OpenAIError as e:
        raise _about_image_blocks(e, chat_request, body) from None
    return adapt(chat, message_id, body.model, tuple(body.stop_sequences or ()),
                 len(chat.requests[0].prompt_token_ids))


def _about_image_blocks(err: OpenAIError, chat_request: ChatCompletionRequest,
                        body: MessagesRequest) -> OpenAIError:
    """Chat's error about its k-th image part, said of the k-th image block: Anthropic's error
    shape has no `param`, so the message names the block's field instead of chat's part."""
    chat_fields = [param for param, _ in chat_request.image_urls()]
    if err.param not in chat_fields:
        return err
    field = body.image_fields()[chat_fields.index(err.param)]
    reason = err.message.removeprefix(_CHAT_FIELD).removeprefix(":").strip()
    return OpenAIError(err.status, f"{field}: {reason}", err.type, param=field)


_CHAT_FIELD = "image_url.url"  # how chat's image errors begin (engine.multimodal.media)


def count_tokens(served: ServedModel, body: MessagesRequest) -> dict:
    """`POST /v1/messages/count_tokens`: the prompt's tokens as the chat template renders it,
    each image as the placeholder tokens it expands to."""
    chat_request = _chat_request(body, "count", max_tokens=1)
    served.check_model(chat_request.model)
    if chat_request.image_urls():  # the expansion needs the decoded image: the chat request, built
        no_tools = _chat_request(body, "count", max_tokens=1, tools=None, tool_choice=None, stream=False)
        try:
            return {"input_tokens": len(chat_job(served, no_tools).requests[0].prompt_token_ids)}
        except OpenAIError as e:
            raise _about_image_blocks(e, no_tools, body) from None
    _, ids = render(served.tokenizer, chat_request, template_kwargs(served.tokenizer, None))
    return {"input_tokens": len(ids)}
