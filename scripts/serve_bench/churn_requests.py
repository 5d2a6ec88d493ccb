"""What churn's clients ask (scripts/churn.py): completions of a few prompts, of three kinds
whose right answer is fixed, so any answer can be checked against the healthy server's:

- greedy;
- seeded sampling (a fixed seed: the same text on every run, migrated or not);
- greedy under a JSON schema (the same text, and valid JSON)."""

from __future__ import annotations

import json

PROMPTS = ["The river ran quietly past", "A good engineer measures before", "Once upon a time there was",
           "Hello! How can I help you", "The capital of France is", "Write a short poem about the sea",
           "List three prime numbers:", "In the beginning the universe"]
# Short enough to finish within a few tokens: a cut answer would not be valid JSON.
_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}},
           "required": ["answer"], "additionalProperties": False}
KINDS = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 1.0, "top_p": 0.9, "seed": 11},
    "json": {"temperature": 0, "extra_body": {"guided_json": _SCHEMA}},
}
JSON_MAX_TOKENS = 32  # at least: the whole object


def openai_client(url: str, timeout_s: float):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout_s)


def ask(client, model: str, prompt: str, max_tokens: int, stream: bool, kind: str = "greedy") -> str:
    """One completion's text, whole or joined from its stream."""
    args = dict(model=model, prompt=prompt, **KINDS[kind],
                max_tokens=max(max_tokens, JSON_MAX_TOKENS) if kind == "json" else max_tokens)
    if not stream:
        return client.completions.create(**args).choices[0].text
    with client.completions.create(**args, stream=True) as chunks:
        return "".join(c.choices[0].text for c in chunks if c.choices)


def check_oracle(right: dict) -> None:
    """The healthy server's answers, `right[(prompt index, kind)]`, are what they must be: a
    "json" one parses (churn's answers are then checked against them, text for text)."""
    for (i, kind), text in right.items():
        if kind == "json":
            try:
                json.loads(text)
            except ValueError as e:
                raise ValueError(f"the healthy server's JSON answer to prompt {i} does not parse: {text!r}") from e
