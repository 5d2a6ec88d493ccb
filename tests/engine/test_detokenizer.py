"""Incremental detokenization is exact even when a character's bytes span tokens."""

from __future__ import annotations

import pytest

from engine.detokenizer import IncrementalDetokenizer, find_stop_string
from engine.llm_engine import load_tokenizer

TEXTS = [
    "Café, naïve, Zürich and Ελλάδα.",
    "日本語の文章、中文的句子、한국어 문장 🙂🚀🌍 done",
    "plain ascii text with  double  spaces\nand a newline",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_deltas_concatenate_to_full_decode(tiny_model, text):
    tok = load_tokenizer(tiny_model)
    prompt = tok.encode("Hello there", add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.step(t) for t in ids]
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_character_split_over_tokens_is_held_until_complete(tiny_model):
    tok = load_tokenizer(tiny_model)
    # A byte-level tokenizer with a tiny vocabulary splits rare CJK/emoji into byte tokens.
    ids = tok.encode("🌍", add_special_tokens=False)
    assert len(ids) > 1, "test needs a character spread over several tokens"
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.step(t) for t in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "🌍"


def test_flush_at_the_end_returns_text_held_behind_an_incomplete_character(tiny_model):
    """A request that ends mid-character must still return the complete characters decoded
    with the partial one, and its text equals decoding all its tokens (what HF shows)."""
    tok = load_tokenizer(tiny_model)
    ids = tok.encode("ab🌍", add_special_tokens=False)
    partial = ids[:-1]  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tok, [])
    streamed = "".join(detok.step(t) for t in partial)
    final = streamed + detok.flush()
    assert final == tok.decode(partial)
    assert final.startswith("ab") and final.endswith("\ufffd")
    assert detok.flush() == ""  # nothing is returned twice


def test_special_tokens_are_skipped_in_text(tiny_model):
    tok = load_tokenizer(tiny_model)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("abc", add_special_tokens=False) + [eos]
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(detok.step(t) for t in ids) == "abc"


def test_find_stop_string_reports_earliest_match_in_new_text():
    assert find_stop_string("hello world. bye", 6, [".", "bye"]) == (".", 11)
    assert find_stop_string("hello world", 3, ["hello"]) is None  # matched earlier text only
    assert find_stop_string("abcSTOP", 2, ["STOP"]) == ("STOP", 3)  # spans old and new text
