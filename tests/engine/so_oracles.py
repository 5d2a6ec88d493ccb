"""Oracles for structured outputs: each checks the constraint itself, never our engine."""

from __future__ import annotations

import json
import re

import jsonschema

# Bounded so that a random-weight model, forced through them, finishes within max_tokens.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "ok"],
    "additionalProperties": False,
}
CODE_REGEX = r"[a-c]{2,4}-[0-9]{1,3}"
CHOICES = ["positive", "negative", "neutral"]
# A Lark grammar and the same language as a Python regex (the oracle).
SUM_GRAMMAR = 'start: NUM "+" NUM "=" NUM\nNUM: /[0-9]{1,2}/\n'
SUM_REGEX = r"[0-9]{1,2}\+[0-9]{1,2}=[0-9]{1,2}"


def assert_valid_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def assert_fullmatch(text: str, pattern: str) -> None:
    assert re.fullmatch(pattern, text), f"{text!r} does not match {pattern!r}"

# The real default model (SmolLM2-135M) asked about France. Its greedy numbers run on ("1111…",
# "314.7888…") until max_tokens when asked plainly, and the grammar allows any number of digits,
# so the question shows one example object: the model copies its shape and stops.
COUNTRY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "capital": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "number"},
    },
    "required": ["name", "capital", "population_millions"],
    "additionalProperties": False,
}
FRANCE_QUESTION = ('Answer with JSON like {"name": "Spain", "capital": "Madrid", "population_millions": 48.6}. '
                   "What about France?")
