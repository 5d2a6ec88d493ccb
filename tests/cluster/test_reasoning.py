"""cluster.http.reasoning: <think>...</think> split as vLLM's deepseek_r1 and qwen3 parsers
split it, whole and streamed (any cut of the text into deltas adds up to the whole split)."""

from __future__ import annotations

import random

import pytest

from cluster.http.reasoning import get_reasoning_parser

CASES = [
    # (parser, text, reasoning, content)
    ("deepseek_r1", "Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
    ("deepseek_r1", "<think>Hmm</think>\n\n4", "Hmm", "\n\n4"),
    ("deepseek_r1", "still thinking when cut", "still thinking when cut", None),
    ("deepseek_r1", "</think>only an answer", "", "only an answer"),
    ("qwen3", "<think>\nsteps\n</think>\n\nDone.", "\nsteps\n", "\n\nDone."),
    ("qwen3", "No thinking here.", None, "No thinking here."),
    ("qwen3", "<think>\n\n</think>\n\nHi", "\n\n", "\n\nHi"),
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("qwen3", "<think>cut mid-way", "cut mid-way", None),
    ("qwen3", "a < b and </thin", None, "a < b and </thin"),
    ("deepseek_r1", "x </thin", "x </thin", None),
]


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
def test_whole_split(name, text, reasoning, content):
    assert get_reasoning_parser(name).split(text) == (reasoning, content)


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
def test_any_cut_into_deltas_streams_the_same_split(name, text, reasoning, content):
    parser = get_reasoning_parser(name)
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = parser.stream()
        parts = [p for piece in pieces for p in stream.feed(piece)] + stream.finish()
        got_r = "".join(t for k, t in parts if k == "reasoning")
        got_c = "".join(t for k, t in parts if k == "content")
        assert (got_r if stream.reasoned else None, got_c or None) == (reasoning, content), pieces
        assert all(t for _, t in parts)  # no empty pieces
        assert "<think>" not in got_r + got_c or "<think>" in text.replace("<think>", "", 1)


def test_an_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("o1")
