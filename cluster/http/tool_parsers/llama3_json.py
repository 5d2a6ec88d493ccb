"""Llama 3.1/3.2 JSON-based calls: the response itself is the call, a JSON object
`{"name": ..., "parameters": {...}}` ("arguments" is accepted for "parameters"), maybe after
`<|python_tag|>`; several calls are separated by `;`.

Only a response that starts (after whitespace) with `{` or `<|python_tag|>{` can hold calls, so
a prose answer streams out at once. An object with any other keys, or whose JSON does not parse,
is not a call: a JSON answer such as `{"name": "Ada", "age": 36}` stays content. Text after the
last call (not `;` and another call) is content.
"""

from __future__ import annotations

from collections.abc import Callable

from cluster.http.tool_parsers.base import (
    JSON_SPACE,
    JsonSpan,
    ParsedOutput,
    ToolCallStream,
    ToolParser,
    dump_arguments,
    load_json,
    skip_space,
)

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"
_KEYS = frozenset({"name", "parameters", "arguments", "type"})


def call_in(object_text: str) -> tuple[str, str] | None:
    """(name, arguments) of the call `object_text` holds, or None."""
    obj = load_json(object_text)
    if not isinstance(obj, dict) or not obj.keys() <= _KEYS:
        return None
    if ("parameters" in obj) == ("arguments" in obj) or obj.get("type", "function") != "function":
        return None
    name, arguments = obj.get("name"), obj.get("parameters", obj.get("arguments"))
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return name, dump_arguments(arguments)


def first_object(text: str) -> int | None:
    """Where the first call's object opens when `text` starts like a call response, else None."""
    pos = skip_space(text, 0)
    if text.startswith(PYTHON_TAG, pos):
        pos = skip_space(text, pos + len(PYTHON_TAG))
    return pos if text.startswith("{", pos) else None


def next_object(text: str, pos: int) -> int | None:
    """Where the next call's object opens when `text[pos:]` is `;` then one, else None."""
    pos = skip_space(text, pos)
    if not text.startswith(SEPARATOR, pos):
        return None
    pos = skip_space(text, pos + len(SEPARATOR))
    return pos if text.startswith("{", pos) else None


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str) -> ParsedOutput:
        calls: list[tuple[str, str, str | None]] = []
        opens, after = first_object(text), 0
        while opens is not None:
            end = JsonSpan(opens).end(text)
            call = None if end is None else call_in(text[opens:end])
            if call is None:
                break
            calls.append((*call, None))
            after = end
            opens = next_object(text, end)
        if not calls:
            return self._output([text], [])
        return self._output([""] * len(calls) + [text[after:]], calls)

    def stream(self) -> ToolCallStream:
        return Llama3JsonStream(self.new_id)


class Llama3JsonStream(ToolCallStream):
    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self._all_content = False  # the rest of the response is content
        # While an object is being read: where it opens in the buffer, and its span.
        self._object_at = 0
        self._span: JsonSpan | None = None

    def _advance(self, final: bool) -> None:
        while self._buffer:
            if self._all_content:
                self._release(len(self._buffer))
                return
            if self._span is None:
                opens = self._object_opens()
                if opens is None:
                    return
                if not opens:
                    self._all_content = True
                    continue
            end = self._span.end(self._buffer)
            if end is None:
                return
            self._span = None
            call = call_in(self._buffer[self._object_at:end])
            if call is None:
                self._all_content = True
                continue
            self._call(*call)
            self._drop(end)

    def _object_opens(self) -> bool | None:
        """Whether a call's object opens next in the buffer (then its span is set up); None while
        the buffer could still go either way."""
        first = not self.tools_called
        at = first_object(self._buffer) if first else next_object(self._buffer, 0)
        if at is not None:
            self._object_at, self._span = at, JsonSpan(at)
            return True
        rest = self._buffer[skip_space(self._buffer, 0):]
        return None if _may_become(rest, PYTHON_TAG if first else SEPARATOR) else False


def _may_become(rest: str, lead: str) -> bool:
    """Whether `rest` could still grow into `lead`, whitespace, then `{`."""
    if len(rest) < len(lead):
        return lead.startswith(rest)
    return rest.startswith(lead) and not rest[len(lead):].strip(JSON_SPACE)
