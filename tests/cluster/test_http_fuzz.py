"""A property-based test over the ingress's OpenAPI schema (schemathesis): whatever the body,
method or field values, the ingress answers below 500, every error in OpenAI's shape, and a
stream never ends in a 5xx error event.

Every operation of the schema (`/openapi.json`: the generation routes, the tokenizer routes,
/health, /metrics, /status, /scale, /v1/models) gets schemathesis's coverage phase (boundary
and schema-violating values of each field, other HTTP methods) and 10 fuzzed cases,
derandomized so every run sends the same cases: 1,505 requests with schemathesis 4.32
(docs/serving.md#limits). The app is the real one (tests/cluster/ingress_harness.py): parsing,
chat templates, tokenization and validation run as in a replica; only the engine is a stand-in.
"""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig

from cluster.http.ingress import app
from tests.cluster.ingress_harness import make_ingress, serve_ingress

NAME = "m"
FUZZED_PER_OPERATION = 10
CONFIG = SchemathesisConfig.from_dict({
    "phases": {"examples": {"enabled": False}, "coverage": {"enabled": True}, "fuzzing": {"enabled": True},
               "stateful": {"enabled": False}},
    "generation": {"max-examples": FUZZED_PER_OPERATION},
})
schema = schemathesis.openapi.from_dict(app.openapi(), config=CONFIG)
# Cases sent, per (method, path, status): a record of what the run covered.
SENT: dict[tuple[str, str, int], int] = {}


@pytest.fixture(scope="module")
def served(tiny_model):
    s = serve_ingress(make_ingress(tiny_model, name=NAME))
    yield s
    s.stop()
    print(f"\nschemathesis sent {sum(SENT.values())} requests:",
          {key: SENT[key] for key in sorted(SENT)})


def _stream_errors(text: str) -> list[dict]:
    """The error objects among an SSE body's `data:` events."""
    errors = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[len("data: "):])
            if isinstance(event, dict) and "error" in event:
                errors.append(event["error"])
    return errors


@schema.parametrize()
@settings(max_examples=FUZZED_PER_OPERATION, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_5xx(case, served):
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = NAME  # the served name: most cases get past the 404 to the validation
    response = case.call(base_url=served.url, timeout=60)
    key = (case.method, case.path, response.status_code)
    SENT[key] = SENT.get(key, 0) + 1
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if response.status_code >= 400:
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], response.text[:500]
    elif "text/event-stream" in response.headers.get("content-type", [""])[0]:
        failed = [e for e in _stream_errors(response.text) if int(e.get("code") or 500) >= 500]
        assert not failed, (case.body, failed)
