"""Tool-call parsers: a model's generated text split into content and OpenAI tool calls, for a
whole response (`parse`) or as it streams (`stream`). One parser per model family's format, chosen
by name as vLLM's `--tool-call-parser NAME` chooses it. Pure Python: no Ray, no engine."""

from __future__ import annotations

from types import MappingProxyType

from cluster.http.tool_parsers.base import (
    ContentDelta,
    ParsedOutput,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
)
from cluster.http.tool_parsers.hermes import HermesToolParser
from cluster.http.tool_parsers.llama3_json import Llama3JsonToolParser
from cluster.http.tool_parsers.mistral import MistralToolParser

# Name -> parser class; iterating it gives the names `--tool-call-parser` accepts.
TOOL_PARSERS = MappingProxyType({
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
})


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`; a ValueError naming the valid ones otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        valid = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool-call parser {name!r}: valid names are {valid}") from None


__all__ = [
    "TOOL_PARSERS",
    "ContentDelta",
    "ParsedOutput",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "get_tool_parser",
]
