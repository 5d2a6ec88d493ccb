"""Mistral calls (Mistral 7B Instruct v0.3 and its tokenizer's format before v11): `[TOOL_CALLS]`
then a JSON array of `{"name": ..., "arguments": {...}}`, each maybe with the model's own "id";
text before the marker is content.

`[TOOL_CALLS]` is a special token: the detokenizer must keep special tokens for it to reach the
parser. A marker not followed by `[` stays content, and so does a marker with an array that is
not a list of calls.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from cluster.http.tool_parsers.base import (
    JsonSpan,
    ParsedOutput,
    ToolCallStream,
    ToolParser,
    dump_arguments,
    load_json,
    marker_prefix_len,
    skip_space,
)

MARKER = "[TOOL_CALLS]"

Call = tuple[str, str, str | None]


def mistral_call_id() -> str:
    """Nine letters and digits: Mistral's chat template refuses a tool_call_id of any other
    shape when the conversation comes back with the call in it."""
    return uuid.uuid4().hex[:9]


def calls_in(array_text: str) -> list[Call] | None:
    """(name, arguments, id or None) of each call in `array_text`, or None unless it is a
    non-empty JSON array of calls. A call without "arguments" takes none (`{}`)."""
    items = load_json(array_text)
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict):
            return None
        name, arguments, call_id = item.get("name"), item.get("arguments", {}), item.get("id")
        if not isinstance(name, str) or not name or not isinstance(arguments, dict):
            return None
        if call_id is not None and (not isinstance(call_id, str) or not call_id):
            return None
        calls.append((name, dump_arguments(arguments), call_id))
    return calls


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True  # [TOOL_CALLS]
    new_id = staticmethod(mistral_call_id)

    def parse(self, text: str) -> ParsedOutput:
        segments: list[str] = []
        calls: list[Call] = []
        current, pos = "", 0
        while (start := text.find(MARKER, pos)) >= 0:
            current += text[pos:start]
            body = skip_space(text, start + len(MARKER))
            if body == len(text) or text[body] != "[":
                current += MARKER
                pos = start + len(MARKER)
                continue
            end = JsonSpan(body).end(text)
            if end is None:
                current += text[start:]
                pos = len(text)
                break
            found = calls_in(text[body:end])
            if found is None:
                current += text[start:end]
            else:
                segments += [current] + [""] * (len(found) - 1)
                current = ""
                calls += found
            pos = end
        segments.append(current + text[pos:])
        return self._output(segments, calls)

    def stream(self) -> ToolCallStream:
        return MistralStream(self.new_id)


class MistralStream(ToolCallStream):
    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        # While the buffer starts with MARKER and an array: where the array opens, and its span.
        self._array_at = 0
        self._span: JsonSpan | None = None

    def _advance(self, final: bool) -> None:
        while self._buffer:
            if self._span is None:
                start = self._buffer.find(MARKER)
                if start < 0:
                    hold = 0 if final else marker_prefix_len(self._buffer, MARKER)
                    self._release(len(self._buffer) - hold)
                    return
                self._release(start)
                body = skip_space(self._buffer, len(MARKER))
                if body == len(self._buffer):
                    return
                if self._buffer[body] != "[":
                    self._release(len(MARKER))
                    continue
                self._array_at, self._span = body, JsonSpan(body)
            end = self._span.end(self._buffer)
            if end is None:
                return
            self._span = None
            found = calls_in(self._buffer[self._array_at:end])
            if found is None:
                self._release(end)
                continue
            for name, arguments, call_id in found:
                self._call(name, arguments, call_id)
            self._drop(end)
