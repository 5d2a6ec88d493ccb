"""Tool-call parsers (cluster.http.tool_parsers): which texts become calls and which stay content,
for each format, and the stream agreeing with the whole parse however the text is split."""

from __future__ import annotations

import json
import random
import re

import pytest

from cluster.http.tool_parsers import (
    TOOL_PARSERS,
    ContentDelta,
    ParsedOutput,
    ToolCallDelta,
    get_tool_parser,
)

OPENAI_ID = re.compile(r"call_[0-9a-f]{24}")
MISTRAL_ID = re.compile(r"[0-9A-Za-z]{9}")


def parse(parser: str, text: str):
    return get_tool_parser(parser)().parse(text)


def calls_of(output) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in output.tool_calls]


def streamed(parser: str, pieces: list[str]) -> tuple[str | None, list[tuple[str, str, str]], bool]:
    """Feed `pieces` to a fresh stream: (joined content or None, [(id, name, arguments)],
    tools_called), checking OpenAI's order on the way: a call's first delta carries its next
    index, id, type and name, the deltas after it only argument fragments of that call."""
    stream = get_tool_parser(parser)().stream()
    deltas = [delta for piece in pieces for delta in stream.feed(piece)] + stream.finish()
    content, calls = "", []
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            assert delta.text
            content += delta.text
            continue
        assert isinstance(delta, ToolCallDelta)
        if delta.index == len(calls):
            assert delta.id and delta.name and delta.type == "function" and delta.arguments is None
            calls.append([delta.id, delta.name, ""])
        else:
            assert delta.index == len(calls) - 1
            assert delta.id is None and delta.name is None and delta.arguments is not None
            calls[-1][2] += delta.arguments
    return content or None, [tuple(call) for call in calls], stream.tools_called


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(len(text) - 1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


WEATHER = '{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "a \\"quoted } ] value"}}'

TEXTS = {
    "hermes": [
        "The weather is sunny.",
        f"<tool_call>\n{WEATHER}\n</tool_call>",
        f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\n",
        f"A <tool_call>{WEATHER}</tool_call> B <tool_call>{TIME}</tool_call> C",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
        "Wrap a call in <tool_call> tags, then close it with </tool_call>.",
        f"<tool_call> is the tag. <tool_call>{TIME}</tool_call>",
        f"<tool_call>\n{WEATHER}",
        "  <tool_call>  ",
        "ends with <tool_",
    ],
    "llama3_json": [
        "The weather is sunny.",
        '{"name": "get_weather", "parameters": {"city": "Zürich"}}',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": "\\"}; {"}}',
        '{"name": "a", "parameters": {}} and some words after',
        '{"name": "a", "parameters": {}}; {"name": "b", "parameters": ',
        '{"name": "Ada", "age": 36}',
        "[1, 2, 3]",
        "<|python_tag|>brave_search.call(query='weather')",
        "   <|python_t",
    ],
    "mistral": [
        "The weather is sunny.",
        f"[TOOL_CALLS] [{TIME}]",
        f'Checking both.[TOOL_CALLS][{WEATHER}, {{"name": "get_time", "arguments": {{}}, "id": "abc123XYZ"}}]',
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}',
        "[TOOL_CALLS] I will not call a tool.",
        '[TOOL_CALLS] [{"tool": "get_weather"}] then prose',
        "[TOOL_CAL",
    ],
}
CASES = [(parser, text) for parser, texts in TEXTS.items() for text in texts]


@pytest.mark.parametrize("parser, text", CASES)
def test_stream_agrees_with_whole_parse_under_random_splits(parser, text):
    whole = parse(parser, text)
    expected = (whole.content, [(call.name, call.arguments) for call in whole.tool_calls])
    rng = random.Random(f"{parser}:{text}")
    splits = [list(text), [text]] + [random_pieces(text, rng) for _ in range(60)]
    for pieces in splits:
        content, calls, tools_called = streamed(parser, pieces)
        assert (content, [(name, arguments) for _, name, arguments in calls]) == expected, pieces
        assert tools_called == whole.tools_called


@pytest.mark.parametrize("parser, text", CASES)
def test_stream_agrees_with_whole_parse_when_split_at_any_one_point(parser, text):
    whole = parse(parser, text)
    expected = [(call.name, call.arguments) for call in whole.tool_calls]
    for cut in range(1, len(text)):
        content, calls, _ = streamed(parser, [text[:cut], text[cut:]])
        assert content == whole.content and [(n, a) for _, n, a in calls] == expected, cut


# Pieces the fuzz test strings together: markers whole and cut, calls, broken JSON, prose.
ATOMS = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool_", "call>", "{", "}", '"', "\\", " ", "\n",
               "text", f"<tool_call>\n{WEATHER}\n</tool_call>", '{"name": "g"}', TIME],
    "llama3_json": ["<|python_tag|>", "<|python", ";", " ", "\n", "{", "}", '"', "text", "[1]",
                    '{"name": "f", "parameters": {"a": "}"}}', '{"name": "g", "arguments": {}}'],
    "mistral": ["[TOOL_CALLS]", "[TOOL_", "CALLS]", "[", "]", "{", "}", '"', " ", "\n", "text",
                f"[{WEATHER}]", '[{"name": "g", "id": "abcdefghi"}, {"name": "h"}]'],
}


@pytest.mark.parametrize("parser", sorted(ATOMS))
def test_stream_agrees_with_whole_parse_on_random_texts(parser):
    rng = random.Random(parser)
    for _ in range(300):
        text = "".join(rng.choice(ATOMS[parser]) for _ in range(rng.randint(2, 8)))
        whole = parse(parser, text)
        expected = (whole.content, [(call.name, call.arguments) for call in whole.tool_calls])
        for pieces in (list(text), random_pieces(text, rng)):
            content, calls, _ = streamed(parser, pieces)
            assert (content, [(n, a) for _, n, a in calls]) == expected, pieces


@pytest.mark.parametrize("parser", sorted(TEXTS))
def test_plain_text_is_content_without_calls(parser):
    out = parse(parser, "The weather is sunny.\n")
    assert out.content == "The weather is sunny.\n" and out.tool_calls == [] and not out.tools_called


@pytest.mark.parametrize("parser", sorted(TEXTS))
def test_whitespace_only_text_has_no_content(parser):
    assert parse(parser, " \n ").content is None


# hermes


def test_hermes_block_becomes_a_call_without_content():
    out = parse("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>")
    assert out.content is None and out.tools_called
    assert calls_of(out) == [("get_weather", {"city": "Zürich", "unit": "celsius"})]


def test_hermes_arguments_keep_non_ascii_as_written():
    out = parse("hermes", f"<tool_call>{WEATHER}</tool_call>")
    assert out.tool_calls[0].arguments == '{"city": "Zürich", "unit": "celsius"}'


def test_hermes_text_before_several_calls_is_content():
    out = parse("hermes", TEXTS["hermes"][2])
    assert out.content == "Let me check."
    assert [name for name, _ in calls_of(out)] == ["get_weather", "get_time"]
    assert calls_of(out)[1][1] == {"tz": 'a "quoted } ] value'}


def test_hermes_text_around_and_between_calls_is_content_without_the_call_spacing():
    assert parse("hermes", TEXTS["hermes"][3]).content == "ABC"


def test_hermes_malformed_json_stays_content_with_its_tags():
    text = TEXTS["hermes"][4]
    out = parse("hermes", text)
    assert out.content == text and not out.tools_called


def test_hermes_tag_in_prose_stays_content():
    text = "Wrap a call in <tool_call> tags, then close it with </tool_call>."
    assert parse("hermes", text) == ParsedOutput(text, [])


def test_hermes_tag_in_prose_does_not_hide_a_later_call():
    out = parse("hermes", f"<tool_call> is the tag. <tool_call>{TIME}</tool_call>")
    assert out.content == "<tool_call> is the tag." and [n for n, _ in calls_of(out)] == ["get_time"]


def test_hermes_block_the_response_ends_in_is_a_call_when_complete():
    assert calls_of(parse("hermes", f"<tool_call>\n{WEATHER}"))[0][0] == "get_weather"


def test_hermes_call_without_arguments_takes_none():
    out = parse("hermes", '<tool_call>{"name": "now"}</tool_call>')
    assert out.tool_calls[0].arguments == "{}"


@pytest.mark.parametrize("block", [
    '{"name": "f", "arguments": "{\\"a\\": 1}"}',
    '{"name": "f", "arguments": {"a": NaN}}',
    '{"arguments": {"a": 1}}',
    '["f", {"a": 1}]',
])
def test_hermes_block_that_is_not_a_call_stays_content(block):
    text = f"<tool_call>{block}</tool_call>"
    assert parse("hermes", text).content == text


def test_hermes_stream_holds_back_a_possible_tag_and_releases_it_when_it_is_not_one():
    stream = get_tool_parser("hermes")().stream()
    assert stream.feed("Hi <tool_") == [ContentDelta("Hi")]
    assert stream.feed("box>") == [ContentDelta(" <tool_box>")]


def test_hermes_stream_emits_a_call_once_its_block_closes():
    stream = get_tool_parser("hermes")().stream()
    assert stream.feed(f"<tool_call>\n{WEATHER}\n</tool_") == []
    first, arguments = stream.feed("call>")
    assert first.name == "get_weather" and arguments.arguments == '{"city": "Zürich", "unit": "celsius"}'


# llama3_json


def test_llama3_json_object_with_parameters_is_a_call():
    out = parse("llama3_json", TEXTS["llama3_json"][1])
    assert out.content is None and calls_of(out) == [("get_weather", {"city": "Zürich"})]


def test_llama3_json_python_tag_prefix_is_not_content():
    out = parse("llama3_json", TEXTS["llama3_json"][2])
    assert out.content is None and calls_of(out) == [("get_weather", {"city": "Paris"})]


def test_llama3_json_calls_separated_by_semicolons_are_several_calls():
    out = parse("llama3_json", TEXTS["llama3_json"][3])
    assert calls_of(out) == [("a", {"x": 1}), ("b", {"y": '"}; {'})] and out.content is None


def test_llama3_json_text_after_the_calls_is_content():
    assert parse("llama3_json", TEXTS["llama3_json"][4]).content == "and some words after"


@pytest.mark.parametrize("text", [
    '{"name": "Ada", "age": 36}',
    '{"name": "f", "parameters": {}, "arguments": {}}',
    '{"name": "f", "parameters": {}, "age": 36}',
    '{"type": "object", "name": "f", "parameters": {}}',
    '{"name": "f", "parameters": [1]}',
    '{"name": "f", "parameters": {"a": 1}',
    "[1, 2, 3]",
    '"get_weather"',
    "42",
    'Here it is: {"name": "f", "parameters": {}}',
    "<|python_tag|>brave_search.call(query='weather')",
])
def test_llama3_json_text_that_is_not_a_call_stays_content(text):
    out = parse("llama3_json", text)
    assert out.content == text and out.tool_calls == []


def test_llama3_json_stream_releases_prose_at_once_and_holds_a_possible_python_tag():
    assert get_tool_parser("llama3_json")().stream().feed("Hello") == [ContentDelta("Hello")]
    assert get_tool_parser("llama3_json")().stream().feed("<|python") == []


# mistral


def test_mistral_array_becomes_calls_and_text_before_it_content():
    out = parse("mistral", TEXTS["mistral"][2])
    assert out.content == "Checking both."
    assert calls_of(out) == [("get_weather", {"city": "Zürich", "unit": "celsius"}), ("get_time", {})]


def test_mistral_array_ends_at_its_own_bracket_not_one_inside_a_string():
    assert calls_of(parse("mistral", TEXTS["mistral"][1])) == [("get_time", {"tz": 'a "quoted } ] value'})]


def test_mistral_keeps_the_models_id_and_makes_mistral_shaped_ones_otherwise():
    out = parse("mistral", TEXTS["mistral"][2])
    assert MISTRAL_ID.fullmatch(out.tool_calls[0].id) and out.tool_calls[1].id == "abc123XYZ"
    _, calls, _ = streamed("mistral", [TEXTS["mistral"][2]])
    assert MISTRAL_ID.fullmatch(calls[0][0]) and calls[1][0] == "abc123XYZ"


@pytest.mark.parametrize("text", [
    "[TOOL_CALLS] I will not call a tool.",
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}',
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": }}]',
    '[TOOL_CALLS] [{"tool": "get_weather"}]',
    "[TOOL_CALLS] []",
    '[TOOL_CALLS] [{"name": "f", "arguments": {}, "id": 7}]',
])
def test_mistral_marker_without_an_array_of_calls_stays_content(text):
    out = parse("mistral", text)
    assert out.content == text and out.tool_calls == []


def test_mistral_stream_holds_back_a_possible_marker():
    stream = get_tool_parser("mistral")().stream()
    assert stream.feed("Sure[TOOL_") == [ContentDelta("Sure")]
    assert stream.finish() == [ContentDelta("[TOOL_")]


# ids, the stream's life, the registry


@pytest.mark.parametrize("parser, text", [
    ("hermes", TEXTS["hermes"][2] + TEXTS["hermes"][1]),
    ("llama3_json", TEXTS["llama3_json"][3] + '; {"name": "c", "parameters": {}}'),
])
def test_generated_ids_are_openai_shaped_and_unique_per_call(parser, text):
    ids = [call.id for _ in range(2) for call in parse(parser, text).tool_calls]
    ids += [call_id for _ in range(2) for call_id, _, _ in streamed(parser, [text])[1]]
    assert len(ids) == 12 and all(OPENAI_ID.fullmatch(i) for i in ids) and len(set(ids)) == 12


def test_stream_refuses_text_after_finish():
    stream = get_tool_parser("hermes")().stream()
    stream.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        stream.feed("x")


def test_registry_names_each_format_by_its_cli_name():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral"]
    assert all(get_tool_parser(name).name == name for name in TOOL_PARSERS)


def test_unknown_parser_name_is_a_value_error_listing_the_valid_names():
    with pytest.raises(ValueError, match="'qwen9'.*hermes, llama3_json, mistral"):
        get_tool_parser("qwen9")
