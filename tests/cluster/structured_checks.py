"""Structured-output checks over HTTP with the official openai client, shared by the P/D and
the colocated Serve tests (each runs them against its own app). Oracles: jsonschema,
re.fullmatch, the choice list, OpenAI's error shape, and the offline engine's output."""

from __future__ import annotations

import json

import openai
import pytest
import requests

from tests.engine.so_oracles import (
    CHOICES,
    CODE_REGEX,
    PERSON_SCHEMA,
    SUM_GRAMMAR,
    SUM_REGEX,
    assert_fullmatch,
    assert_valid_json,
)

PROMPT = "Describe a person:"
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


def check_every_spelling_constrains_sampled_completions(client, name: str) -> None:
    """Temperature 1 on a random-weight model: only the grammar makes these valid."""
    cases = [({"guided_json": PERSON_SCHEMA}, lambda t: assert_valid_json(t, PERSON_SCHEMA)),
             ({"structured_outputs": {"regex": CODE_REGEX}}, lambda t: assert_fullmatch(t, CODE_REGEX)),
             ({"guided_choice": CHOICES}, lambda t: assert_fullmatch(t, "|".join(CHOICES))),
             ({"guided_grammar": SUM_GRAMMAR}, lambda t: assert_fullmatch(t, SUM_REGEX)),
             ({"guided_regex": CODE_REGEX}, lambda t: assert_fullmatch(t, CODE_REGEX))]
    for seed, (extra, check) in enumerate(cases):
        r = client.completions.create(model=name, prompt=PROMPT, max_tokens=60, temperature=1.0, seed=seed,
                                      extra_body=extra)
        assert r.choices[0].finish_reason == "stop", (extra, r.choices[0].text)
        check(r.choices[0].text)


def check_chat_response_format_plain_and_streamed(client, name: str) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    kw = dict(model=name, messages=MESSAGES, max_tokens=60, temperature=1.0, seed=11, response_format=rf)
    plain = client.chat.completions.create(**kw)
    assert plain.choices[0].finish_reason == "stop"
    assert_valid_json(plain.choices[0].message.content, PERSON_SCHEMA)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content
    # json_object with the closers favoured, so that a correct server always ends the object
    # and stops (tests/engine/test_structured_output.py's closing_bias says why).
    obj = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=100, temperature=1.0, seed=2,
                                         response_format={"type": "json_object"},
                                         logit_bias=closing_bias(client, name))
    text = obj.choices[0].message.content
    assert obj.choices[0].finish_reason == "stop", text  # never cut by max_tokens: the object ended
    assert isinstance(json.loads(text), dict), text


def closing_bias(client, name: str) -> dict[str, int]:
    """logit_bias +100 on the tokens `"`, `}` and `]`, their ids from the server's /tokenize."""
    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    bias = {}
    for closer in ('"', "}", "]"):
        r = requests.post(f"{root}/tokenize", json={"model": name, "prompt": closer, "add_special_tokens": False},
                          timeout=30)
        assert r.status_code == 200, r.text
        tokens = r.json()["tokens"]
        assert len(tokens) == 1, (closer, tokens)  # one token each, or the bias misses
        bias[str(tokens[0])] = 100
    return bias


# Bad bodies, each with the `param` its 400 must name.
BAD_BODIES = [
    ({"guided_regex": "a("}, "guided_regex"),
    ({"guided_json": {"type": "foo"}}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": PERSON_SCHEMA, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs"),
]


def check_bad_specs_are_openai_400s_and_the_server_keeps_serving(client, app: str, name: str) -> None:
    for extra, param in BAD_BODIES:
        for path, body in (("completions", {"prompt": PROMPT}), ("chat/completions", {"messages": MESSAGES})):
            r = requests.post(f"{app}/v1/{path}", json={"model": name, "max_tokens": 8, **body, **extra}, timeout=60)
            assert r.status_code == 400, (extra, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=name, prompt=PROMPT, max_tokens=8, extra_body={"guided_regex": "("})
    r = client.completions.create(model=name, prompt=PROMPT, max_tokens=20, extra_body={"guided_choice": CHOICES})
    assert r.choices[0].text in CHOICES


def check_equals_offline(client, name: str, tiny_model: str, engine_kwargs: dict) -> None:
    """Seeded sampling under a grammar gives the offline engine's exact text (P/D: the
    prefill samples the first token under the grammar, the decode replays it and goes on)."""
    from engine import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(tiny_model, **engine_kwargs)
    for seed, so in enumerate([StructuredOutputsParams(json=PERSON_SCHEMA), StructuredOutputsParams(regex=CODE_REGEX)]):
        offline = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=seed, max_tokens=60,
                                                        structured_outputs=so), use_tqdm=False)[0].outputs[0]
        extra = {"guided_json": so.json} if so.json else {"guided_regex": so.regex}
        r = client.completions.create(model=name, prompt=PROMPT, max_tokens=60, temperature=1.0, seed=seed,
                                      extra_body=extra)
        assert r.choices[0].text == offline.text and r.choices[0].finish_reason == offline.finish_reason
    llm.engine.core.shutdown()
