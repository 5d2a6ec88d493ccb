"""What every tool-call parser shares: the typed results (whole response and stream deltas), call
ids, the JSON rules, the hold-back of a possible marker, and the one content rule both paths
follow.

NOTE: a call is emitted only once its JSON is complete and valid, as one name delta and one
arguments delta. Streaming the arguments as they arrive would announce a call before it is known
to be one; if it then turned out malformed, the stream would have made a call that the whole
parse (which keeps malformed calls as content) does not. With this rule both paths always agree.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

# The JSON whitespace that may surround a value (what `json.loads` skips).
JSON_SPACE = " \t\n\r"


@dataclass(frozen=True)
class ToolCall:
    """One call as OpenAI's `message.tool_calls[i]`: `arguments` is a JSON object as a string."""

    id: str
    name: str
    arguments: str
    type: ClassVar[str] = "function"


@dataclass(frozen=True)
class ParsedOutput:
    """A whole response split into the text that is not a call and the calls."""

    content: str | None
    tool_calls: list[ToolCall]

    @property
    def tools_called(self) -> bool:
        """Whether the response made a call (the choice's finish_reason is then `tool_calls`)."""
        return bool(self.tool_calls)


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of call `index`, in OpenAI's streaming order: the first carries the id and the
    name, the ones after it fragments of the arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    @property
    def type(self) -> str | None:
        return "function" if self.id is not None else None


StreamDelta = ContentDelta | ToolCallDelta


def openai_call_id() -> str:
    """`call_` and 24 hex digits, the shape of OpenAI's ids."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def load_json(text: str) -> object | None:
    """The JSON value `text` holds, or None when it holds none. NaN and Infinity are refused
    because a client's JSON parser would refuse the arguments they end up in."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None


def dump_arguments(arguments: dict) -> str:
    """The one spelling of a call's arguments, in the whole parse and in the stream alike."""
    return json.dumps(arguments, ensure_ascii=False)


def skip_space(text: str, pos: int) -> int:
    """The index of the first character at or after `pos` that is not JSON whitespace."""
    while pos < len(text) and text[pos] in JSON_SPACE:
        pos += 1
    return pos


def marker_prefix_len(text: str, marker: str) -> int:
    """The length of the longest end of `text` that could begin `marker`: the text a stream must
    hold back until the next delta says whether the marker follows."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class JsonSpan:
    """Finds where the JSON object or array that opens at `start` ends, counting brackets outside
    strings; it resumes where it stopped when called again on the same text grown longer.
    Mismatched brackets also end the span: `load_json` then refuses it."""

    def __init__(self, start: int) -> None:
        self._pos = start
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def end(self, text: str) -> int | None:
        """The index just past the value, or None when `text` ends before it does."""
        for pos in range(self._pos, len(text)):
            char = text[pos]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return pos + 1
        self._pos = len(text)
        return None


def join_content(segments: list[str]) -> str | None:
    """The content of a response whose non-call text is `segments`, one more than there are
    calls: whitespace that touches a call is dropped, the rest is kept as written; None when
    nothing but whitespace is left (OpenAI's `content: null` beside tool calls)."""
    last = len(segments) - 1
    parts = []
    for i, segment in enumerate(segments):
        if i > 0:
            segment = segment.lstrip()
        if i < last:
            segment = segment.rstrip()
        parts.append(segment)
    content = "".join(parts)
    return content if content.strip() else None


class ToolCallStream(ABC):
    """Parses one response as it is generated: `feed` each new piece of text, then `finish` once.
    Content comes out as soon as it cannot be part of a call; a call once its JSON is complete.
    The content deltas join into `ParsedOutput.content` of the whole text (or "" for None), and
    the calls match its `tool_calls` (ids aside, which each path makes anew)."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self._new_id = new_id
        self._buffer = ""  # received text not yet emitted as content or a call
        self._out: list[StreamDelta] = []
        self._calls = 0
        self._held_space = ""  # whitespace kept until it is known not to touch a call
        self._after_call = False
        self._content_sent = False
        self._finished = False

    @property
    def tools_called(self) -> bool:
        """Whether a call has been emitted (the choice's finish_reason is then `tool_calls`)."""
        return self._calls > 0

    def feed(self, delta_text: str) -> list[StreamDelta]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buffer += delta_text
        self._advance(final=False)
        return self._take()

    def finish(self) -> list[StreamDelta]:
        """Decide what is still held back: the response ended."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        self._advance(final=True)
        if self._buffer:
            self._content(self._buffer)
            self._buffer = ""
        if self._held_space and self._content_sent and not self._after_call:
            self._out.append(ContentDelta(self._held_space))
        return self._take()

    @abstractmethod
    def _advance(self, final: bool) -> None:
        """Emit what the buffer has decided (`_release`, `_call` then `_drop`). When `final`, no
        more text will come: what is still undecided after it is content."""

    def _release(self, n: int) -> None:
        """The first `n` characters of the buffer are content."""
        self._content(self._buffer[:n])
        self._buffer = self._buffer[n:]

    def _drop(self, n: int) -> None:
        """The first `n` characters of the buffer were syntax of a call just emitted."""
        self._buffer = self._buffer[n:]

    def _content(self, text: str) -> None:
        # The same rule as join_content: trailing whitespace waits for what follows it.
        pending = self._held_space + text
        body = pending.rstrip()
        self._held_space = pending[len(body):]
        if not body:
            return
        if self._after_call:
            body = body.lstrip()
            self._after_call = False
        self._out.append(ContentDelta(body))
        self._content_sent = True

    def _call(self, name: str, arguments: str, call_id: str | None = None) -> None:
        self._held_space = ""
        self._after_call = True
        index = self._calls
        self._calls += 1
        self._out.append(ToolCallDelta(index, call_id or self._new_id(), name))
        self._out.append(ToolCallDelta(index, arguments=arguments))

    def _take(self) -> list[StreamDelta]:
        out, self._out = self._out, []
        return out


class ToolParser(ABC):
    """One model family's tool-call format (vLLM's `--tool-call-parser NAME`). Parsers keep no
    state: `stream()` starts a fresh one per response."""

    name: ClassVar[str]
    # Its marker is a special token, which the detokenizer must keep in the text.
    keeps_special_tokens: ClassVar[bool] = False

    @staticmethod
    def new_id() -> str:
        return openai_call_id()

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """The calls in a whole response; text that is not a valid call stays content."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """An incremental parser for one response."""

    def _output(self, segments: list[str], calls: list[tuple[str, str, str | None]]) -> ParsedOutput:
        """`calls` as (name, arguments, the model's own id or None) between `segments`."""
        tool_calls = [ToolCall(call_id or self.new_id(), name, arguments)
                      for name, arguments, call_id in calls]
        return ParsedOutput(join_content(segments), tool_calls)
