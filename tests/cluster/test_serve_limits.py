"""The lists a request body may carry (cluster/http/request_limits.py), through a real server:
bodies within the 32 MiB body limit that hold far more than a request needs (built here, not
stored) are 400s naming the field and its bound, and the server goes on answering as before.
Each list's own bound without Serve: tests/cluster/test_request_limits.py."""

from __future__ import annotations

import requests

from cluster.http.request_limits import (
    MAX_BAD_WORDS,
    MAX_GUIDED_CHOICES,
    MAX_STOP_STRINGS,
    MAX_TOOLS,
)
from tests.cluster.helpers import SHARED_NAME, assert_no_leaks

CHAT = {"model": SHARED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _tool(i: int) -> dict:
    return {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}


# (route, body, the field the 400 names, words its message holds)
OVERSIZED = [
    ("chat/completions", {**CHAT, "tools": [_tool(i) for i in range(60_000)], "tool_choice": "none"},
     "tools", ["60000", str(MAX_TOOLS), "--max-tools"]),
    ("completions", {"model": SHARED_NAME, "prompt": [[1]] * 2_000_000, "max_tokens": 1},
     "prompt", ["2000000", "--max-pending-requests"]),
    ("chat/completions", {**CHAT, "stop": [f"s{i}" for i in range(500_000)]},
     "stop", ["500000", str(MAX_STOP_STRINGS), "--max-stop-strings"]),
    ("chat/completions", {**CHAT, "allowed_token_ids": [1] * 3_000_000},
     "allowed_token_ids", ["3000000", "vocabulary"]),
    ("chat/completions", {**CHAT, "bad_words": [f"w{i}" for i in range(200_000)]},
     "bad_words", ["200000", str(MAX_BAD_WORDS), "--max-bad-words"]),
    ("chat/completions", {**CHAT, "guided_choice": [f"c{i}" for i in range(200_000)]},
     "guided_choice", ["200000", str(MAX_GUIDED_CHOICES), "--max-guided-choices"]),
    ("responses", {"model": SHARED_NAME, "input": "hi", "tools": [
        {"type": "function", "name": f"f{i}", "parameters": {"type": "object"}} for i in range(60_000)]},
     "tools", ["60000", "--max-tools"]),
]


def test_oversized_lists_are_400s_naming_the_field_and_the_server_goes_on(app, client, shared_app):
    for route, body, param, words in OVERSIZED:
        r = requests.post(f"{app}/v1/{route}", json=body, timeout=120)
        assert r.status_code == 400, (route, param, r.text[:300])
        error = r.json()["error"]
        assert error["param"] == param and all(w in error["message"] for w in words), (route, error)
    # At the bound a list is taken.
    ok = client.chat.completions.create(**CHAT, stop=[f"never-{i}" for i in range(MAX_STOP_STRINGS)])
    assert ok.usage.completion_tokens == 2
    assert_no_leaks(app, shared_app.name, shared_app.roles)
