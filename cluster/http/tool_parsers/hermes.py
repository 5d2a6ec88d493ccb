"""Hermes-style calls (Hermes 2 Pro and later, Qwen2.5, Qwen3): each call is a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, any number of them,
anywhere in the text; the text around them is content.

A `<tool_call>` whose next non-space character is not `{` is prose that mentions the tag, and
stays content. A block whose JSON is not a call stays content with its tags. A last block that
the response ends inside (no `</tool_call>`) is still a call if its JSON is one.
"""

from __future__ import annotations

from collections.abc import Callable

from cluster.http.tool_parsers.base import (
    ParsedOutput,
    ToolCallStream,
    ToolParser,
    dump_arguments,
    load_json,
    marker_prefix_len,
    skip_space,
)

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def call_in(block: str) -> tuple[str, str] | None:
    """(name, arguments) of the call `block` (the text between the tags) holds, or None. A call
    without "arguments" takes none (`{}`); other keys are ignored."""
    obj = load_json(block)
    if not isinstance(obj, dict):
        return None
    name, arguments = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return name, dump_arguments(arguments)


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str) -> ParsedOutput:
        segments: list[str] = []
        calls: list[tuple[str, str, str | None]] = []
        current, pos = "", 0
        while (start := text.find(OPEN, pos)) >= 0:
            current += text[pos:start]
            inner = start + len(OPEN)
            body = skip_space(text, inner)
            if body < len(text) and text[body] != "{":
                current += OPEN
                pos = inner
                continue
            close = text.find(CLOSE, inner)
            end = len(text) if close < 0 else close + len(CLOSE)
            call = call_in(text[inner:len(text) if close < 0 else close])
            if call is None:
                current += text[start:end]
            else:
                segments.append(current)
                current = ""
                calls.append((*call, None))
            pos = end
        segments.append(current + text[pos:])
        return self._output(segments, calls)

    def stream(self) -> ToolCallStream:
        return HermesStream(self.new_id)


class HermesStream(ToolCallStream):
    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        # While the buffer starts with OPEN: where to look for CLOSE next (None outside a block).
        self._close_from: int | None = None

    def _advance(self, final: bool) -> None:
        while self._buffer:
            if self._close_from is None:
                start = self._buffer.find(OPEN)
                if start < 0:
                    hold = 0 if final else marker_prefix_len(self._buffer, OPEN)
                    self._release(len(self._buffer) - hold)
                    return
                self._release(start)
                self._close_from = len(OPEN)
            body = skip_space(self._buffer, len(OPEN))
            if body == len(self._buffer):
                return
            if self._buffer[body] != "{":
                self._close_from = None
                self._release(len(OPEN))
                continue
            close = self._buffer.find(CLOSE, self._close_from)
            if close < 0:
                self._close_from = max(len(OPEN), len(self._buffer) - len(CLOSE) + 1)
                if final and (call := call_in(self._buffer[len(OPEN):])) is not None:
                    self._call(*call)
                    self._drop(len(self._buffer))
                return
            self._close_from = None
            end = close + len(CLOSE)
            call = call_in(self._buffer[len(OPEN):close])
            if call is None:
                self._release(end)
            else:
                self._call(*call)
                self._drop(end)
