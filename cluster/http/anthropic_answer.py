"""The Messages API's answer, made from the chat route's: the chat response as an Anthropic
Message, the chat chunks as the Messages stream's events (message_start, one content block at
a time: content_block_start, its deltas, content_block_stop; message_delta, message_stop),
each on an `event:` line, in the shapes the anthropic SDK parses."""

from __future__ import annotations

import dataclasses
import json
from contextlib import aclosing

from pydantic import RootModel

from cluster.http.errors import OpenAIError, anthropic_error_body
from cluster.http.openai_models import ChatCompletionChunk
from cluster.http.served_model import Job, SSEFormat


def _stop(finish: str | None, stop_reason, stop_sequences: tuple[str, ...]) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) in Anthropic's words for chat's finish and vLLM's stop_reason."""
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls":
        return "tool_use", None
    if isinstance(stop_reason, str) and stop_reason in stop_sequences:
        return "stop_sequence", stop_reason
    return ("end_turn", None) if finish is not None else (None, None)


def _usage(input_tokens: int, output_tokens: int, cached: int | None = None) -> dict:
    usage = {"input_tokens": input_tokens, "output_tokens": output_tokens}
    if cached is not None:
        usage["cache_read_input_tokens"] = cached
    return usage


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def adapt(chat: Job, message_id: str, model: str, stop_sequences: tuple[str, ...], input_tokens: int) -> Job:
    def shell(content: list, stop: tuple[str | None, str | None], usage: dict) -> dict:
        return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    def whole(finals):
        answer = chat.whole(finals)
        choice, usage = answer.choices[0], answer.usage
        message = choice.message
        content = [{"type": "text", "text": message.content}] if message.content else []
        for call in message.tool_calls or ():
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except ValueError:
                arguments = {"_raw": call.function.arguments}  # a length cut: what was written
            content.append({"type": "tool_use", "id": call.id, "name": call.function.name, "input": arguments})
        details = usage.prompt_tokens_details
        return JSONAnswer(root=shell(content, _stop(choice.finish_reason, choice.stop_reason, stop_sequences),
                                _usage(usage.prompt_tokens, usage.completion_tokens,
                                       details.cached_tokens if details else None)))

    async def chunks(merged):
        events = _Events()
        yield {"type": "message_start", "message": shell([], (None, None), _usage(input_tokens, 0))}
        async with aclosing(chat.chunks(merged)) as chat_chunks:
            async for chunk in chat_chunks:
                for event in events.feed(chunk):
                    yield event
        for event in events.close():
            yield event
        stop = _stop(events.finish, events.stop_reason, stop_sequences)
        yield {"type": "message_delta", "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
               "usage": {"output_tokens": events.output_tokens}}
        yield {"type": "message_stop"}

    def failure(err: OpenAIError) -> dict:
        return anthropic_error_body(err)

    return dataclasses.replace(chat, chunks=chunks, whole=whole,
                               sse=SSEFormat(piece=_sse, failure=failure, done=False))


class JSONAnswer(RootModel[dict]):
    """A whole Message as the body the ingress sends (fmt.json_response takes a model)."""


class _Events:
    """Chat chunks in, content-block events out: text and each tool call as its own block,
    closed before the next opens (chat streams a call whole before the next)."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "text" or a chat tool call's index, as a string
        self.finish = None
        self.stop_reason = None
        self.output_tokens = 0

    def feed(self, chunk: ChatCompletionChunk) -> list[dict]:
        if chunk.usage is not None:
            self.output_tokens = chunk.usage.completion_tokens
        events: list[dict] = []
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                if self.open != "text":
                    events += self._start({"type": "text", "text": ""}, "text")
                events.append(self._delta({"type": "text_delta", "text": delta.content}))
            for call in delta.tool_calls or ():
                if self.open != f"call{call.index}":
                    events += self._start({"type": "tool_use", "id": call.id, "name": call.function.name,
                                           "input": {}}, f"call{call.index}")
                if call.function is not None and call.function.arguments:
                    events.append(self._delta({"type": "input_json_delta", "partial_json": call.function.arguments}))
            if choice.finish_reason is not None:
                self.finish = choice.finish_reason
                self.stop_reason = getattr(choice, "stop_reason", None)
        return events

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _start(self, block: dict, key: str) -> list[dict]:
        events = self.close()
        self.index += 1
        self.open = key
        return events + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}
