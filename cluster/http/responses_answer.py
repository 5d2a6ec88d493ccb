"""The Responses API's answer, made from the chat route's: the chat response as a Response
object, the chat chunks as the Responses stream's typed events (each on an `event:` line, no
`data: [DONE]`), in OpenAI's shapes (the openai SDK parses them into its models)."""

from __future__ import annotations

import dataclasses
import uuid
from contextlib import aclosing

from cluster.http import openai_format as fmt
from cluster.http.errors import OpenAIError
from cluster.http.openai_models import ChatCompletionChunk, DeltaToolCall, Usage
from cluster.http.responses_models import (
    ContentPartAdded,
    ContentPartDone,
    ErrorEvent,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionToolCall,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    Response,
    ResponseCompleted,
    ResponseCreated,
    ResponseEvent,
    ResponseIncomplete,
    ResponseInProgress,
    ResponseUsage,
)
from cluster.http.served_model import Job, SSEFormat


@dataclasses.dataclass(frozen=True)
class Shell:
    """What every Response object of one request shares: its id, time, model and echoed settings."""

    id: str
    created_at: int
    model: str
    echo: dict

    def response(self, output: list[OutputItem], status: str, usage: ResponseUsage | None) -> Response:
        return Response(id=self.id, created_at=self.created_at, model=self.model, status=status, output=output,
                        usage=usage, incomplete_details=(IncompleteDetails(reason="max_output_tokens")
                                                         if status == "incomplete" else None), **self.echo)


def adapt(chat: Job, shell: Shell) -> Job:
    """`chat` answering as the Responses API: its response as a Response object, its chunks as
    the Responses stream's events."""

    def whole(finals) -> Response:
        answer = chat.whole(finals)
        choice = answer.choices[0]  # n is 1
        status = _status(choice.finish_reason)
        content, calls = choice.message.content, choice.message.tool_calls or []
        reasoning = choice.message.reasoning_content
        output = [_Item(0, _new_id("rs"), text=reasoning, reasoning=True)] if reasoning is not None else []
        if content or not calls:
            output.append(_Item(len(output), _new_id("msg"), text=content or ""))
        output += [_Item(len(output) + i, _new_id("fc"), (c.id, c.function.name), c.function.arguments)
                   for i, c in enumerate(calls)]
        # Every item but the last is whole; the last is what a length cut cut.
        items = [item.as_model("completed" if item is not output[-1] else status) for item in output]
        return shell.response(items, status, _usage(answer.usage))

    events = Events(shell)

    async def chunks(merged):
        for event in events.start():
            yield event
        async with aclosing(chat.chunks(merged)) as chat_chunks:
            async for chunk in chat_chunks:
                for event in events.feed(chunk):
                    yield event
        for event in events.end():
            yield event

    return dataclasses.replace(chat, chunks=chunks, whole=whole,
                               sse=SSEFormat(piece=_event_sse, failure=events.failure, done=False))


def _event_sse(event: ResponseEvent) -> str:
    """OpenAI's Responses stream names each event on an `event:` line."""
    return f"event: {event.type}\n{fmt.sse(event)}"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _usage(usage: Usage) -> ResponseUsage:
    details = usage.prompt_tokens_details  # always asked of the chat job (responses_job)
    return ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                         total_tokens=usage.total_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=details.cached_tokens if details else 0))


@dataclasses.dataclass
class _Item:
    """One output item: an assistant message's text, or (with `call`: its call_id and name) a
    function call's arguments."""

    index: int  # in the response's `output`
    id: str
    call: tuple[str, str] | None = None
    text: str = ""
    reasoning: bool = False  # the thinking of a reasoning model (--reasoning-parser)

    def as_model(self, status: str) -> OutputItem:
        """The item as the Response lists it; "in_progress" is how it is announced, still empty."""
        text = "" if status == "in_progress" else self.text
        if self.reasoning:
            return ReasoningItem(id=self.id, status=status,
                                 content=[] if status == "in_progress" else [ReasoningText(text=text)])
        if self.call is None:
            return OutputMessage(id=self.id, status=status,
                               content=[] if status == "in_progress" else [OutputText(text=text)])
        call_id, name = self.call
        return FunctionToolCall(id=self.id, status=status, call_id=call_id, name=name, arguments=text)


class Events:
    """Chat chunks in, the Responses stream's events out, in OpenAI's order: response.created,
    response.in_progress, each output item whole (added, its text or arguments, done) before the
    next, then response.completed (or response.incomplete) with the Response they add up to.
    Every event has the next `sequence_number`, a failure's `error` event included.

    NOTE: chat streams each tool call whole before the next (cluster.http.tool_parsers emits
    a call once complete), so a call's argument fragments always belong to the open item.
    """

    def __init__(self, shell: Shell) -> None:
        self.shell = shell
        self.sequence = 0
        self.output: list[OutputItem] = []  # the closed items, as the final Response lists them
        self.open: _Item | None = None
        self.calls: dict[int, _Item] = {}  # chat's tool call index -> its item
        self.finish: str | None = None
        self.usage: ResponseUsage | None = None

    def event(self, kind: type[ResponseEvent], **fields) -> ResponseEvent:
        self.sequence += 1
        return kind(sequence_number=self.sequence - 1, **fields)

    def start(self) -> list[ResponseEvent]:
        response = self.shell.response([], "in_progress", None)
        return [self.event(ResponseCreated, response=response), self.event(ResponseInProgress, response=response)]

    def feed(self, chunk: ChatCompletionChunk) -> list[ResponseEvent]:
        if chunk.usage is not None:
            self.usage = _usage(chunk.usage)
        events = []
        for choice in chunk.choices:  # one: n is 1
            delta = choice.delta
            if delta.reasoning_content:
                events += self._reasoning(delta.reasoning_content)
            if delta.content:
                events += self._text(delta.content)
            for call in delta.tool_calls or ():
                events += self._call(call)
            if choice.finish_reason is not None:
                self.finish = choice.finish_reason
        return events

    def end(self) -> list[ResponseEvent]:
        # An answer with neither text nor a call (thinking at most) ends with one empty message,
        # as the whole response's.
        answered = any(not isinstance(i, ReasoningItem) for i in self.output) or (
            self.open is not None and not self.open.reasoning)
        events = [] if answered else self._close("completed") + self._open(_Item(len(self.output), _new_id("msg")))
        status = _status(self.finish)
        events += self._close(status)
        kind = ResponseIncomplete if status == "incomplete" else ResponseCompleted
        return events + [self.event(kind, response=self.shell.response(self.output, status, self.usage))]

    def failure(self, err: OpenAIError) -> ErrorEvent:
        """The `error` event that ends a stream whose request failed."""
        return self.event(ErrorEvent, code=err.code or err.type, message=err.message)

    def _reasoning(self, delta: str) -> list[ResponseEvent]:
        events = []
        if self.open is None or not self.open.reasoning:
            events = self._close("completed")
            events += self._open(_Item(len(self.output), _new_id("rs"), reasoning=True))
        item = self.open
        item.text += delta
        return events + [self.event(ReasoningTextDelta, item_id=item.id, output_index=item.index, content_index=0,
                                    delta=delta)]

    def _text(self, delta: str) -> list[ResponseEvent]:
        events = []
        if self.open is None or self.open.call is not None or self.open.reasoning:
            events = self._close("completed")
            events += self._open(_Item(len(self.output), _new_id("msg")))
        item = self.open
        item.text += delta
        return events + [self.event(OutputTextDelta, item_id=item.id, output_index=item.index, content_index=0,
                                    delta=delta)]

    def _call(self, call: DeltaToolCall) -> list[ResponseEvent]:
        events = []
        item = self.calls.get(call.index)
        if item is None:
            events = self._close("completed")
            item = _Item(len(self.output), _new_id("fc"), (call.id, call.function.name))
            events += self._open(item)
            self.calls[call.index] = item
        fragment = call.function.arguments if call.function is not None else None
        if fragment:
            item.text += fragment
            events.append(self.event(FunctionCallArgumentsDelta, item_id=item.id, output_index=item.index,
                                     delta=fragment))
        return events

    def _open(self, item: _Item) -> list[ResponseEvent]:
        self.open = item
        events = [self.event(OutputItemAdded, output_index=item.index, item=item.as_model("in_progress"))]
        if item.call is None and not item.reasoning:
            events.append(self.event(ContentPartAdded, item_id=item.id, output_index=item.index, content_index=0,
                                     part=OutputText(text="")))
        return events

    def _close(self, status: str) -> list[ResponseEvent]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item.id, "output_index": item.index}
        if item.reasoning:
            events = [self.event(ReasoningTextDone, **where, content_index=0, text=item.text)]
        elif item.call is None:
            events = [self.event(OutputTextDone, **where, content_index=0, text=item.text),
                      self.event(ContentPartDone, **where, content_index=0, part=OutputText(text=item.text))]
        else:
            events = [self.event(FunctionCallArgumentsDone, **where, arguments=item.text)]
        self.output.append(item.as_model(status))
        return events + [self.event(OutputItemDone, output_index=item.index, item=self.output[-1])]
