"""usage.prompt_tokens_details.cached_tokens (vLLM's --enable-prompt-tokens-details) and the
Responses API's input_tokens_details.cached_tokens: the prompt tokens a real engine found in
its prefix cache, as the engine counted them, read by the official openai client."""

from __future__ import annotations

import pytest

from tests.cluster.ingress_harness import make_ingress, serve_ingress

NAME = "m"
BLOCK = 16
# Long enough for several full blocks: a prefix cache hit covers whole blocks only.
TEXT = " ".join(f"word{i}" for i in range(60))


@pytest.fixture(scope="module")
def engine(tiny_model):
    from engine import AsyncLLM, EngineArgs

    eng = AsyncLLM.from_engine_args(EngineArgs(tiny_model, max_model_len=256, block_size=BLOCK,
                                               enable_prefix_caching=True))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module", params=[True, False], ids=["details", "no-details"])
def served(request, tiny_model, engine):
    ingress = make_ingress(tiny_model, name=NAME, engines=engine)
    ingress.served = type(ingress.served)(**{**ingress.served.__dict__, "prompt_tokens_details": request.param})
    s = serve_ingress(ingress)
    yield s, request.param
    s.stop()


def _client(url):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def test_a_repeated_prompt_reports_its_cached_tokens_whole_and_streamed(served, engine):
    s, details = served
    client = _client(s.url)
    salt = f"{details}"  # a prompt of its own per parameter: the first ask is cold
    messages = [{"role": "user", "content": f"{salt} {TEXT}"}]
    first = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, temperature=0)
    stream = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    completion = client.completions.create(model=NAME, prompt=f"{salt} {TEXT}", max_tokens=2, temperature=0)
    completion_again = client.completions.create(model=NAME, prompt=f"{salt} {TEXT}", max_tokens=2, temperature=0)
    if not details:
        for usage in (first.usage, again.usage, stream[-1].usage, completion.usage):
            assert usage.prompt_tokens_details is None
        return
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # cold
    # Warm: every full block of the prompt but the last token's (the engine computes at least one).
    expected = (n - 1) // BLOCK * BLOCK
    assert expected >= 2 * BLOCK
    assert again.usage.prompt_tokens_details.cached_tokens == expected
    assert stream[-1].usage.prompt_tokens_details.cached_tokens == expected
    m = completion.usage.prompt_tokens
    assert completion_again.usage.prompt_tokens_details.cached_tokens == (m - 1) // BLOCK * BLOCK


def test_the_responses_api_always_reports_cached_input_tokens(served):
    s, details = served
    client = _client(s.url)
    text = f"responses {details} {TEXT}"
    first = client.responses.create(model=NAME, input=text, max_output_tokens=2)
    again = client.responses.create(model=NAME, input=text, max_output_tokens=2)
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert again.usage.input_tokens_details.cached_tokens == (again.usage.input_tokens - 1) // BLOCK * BLOCK > 0


def test_a_cache_salt_keeps_a_tenants_prefix_apart(served):
    """vLLM's cache_salt: the same prompt under another salt finds nothing cached; under its
    own salt it does."""
    s, details = served
    if not details:
        return
    client = _client(s.url)
    messages = [{"role": "user", "content": f"salted {TEXT}"}]

    def cached(salt):
        extra = {} if salt is None else {"cache_salt": salt}
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, temperature=0, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(None) == 0
    assert cached("tenant-a") == 0 and cached("tenant-b") == 0  # not the unsalted entries
    assert cached("tenant-a") > 0 and cached(None) > 0


def test_priority_needs_the_priority_policy_and_a_salt_must_be_a_string(served):
    import requests

    s, _ = served
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for extra, param in (({"priority": 3}, "priority"), ({"cache_salt": ""}, "cache_salt")):
        for route, b in (("chat/completions", body), ("completions", {"model": NAME, "prompt": "hi", "max_tokens": 2})):
            r = requests.post(f"{s.url}/v1/{route}", json={**b, **extra}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = requests.post(f"{s.url}/v1/responses", json={"model": NAME, "input": "hi", "priority": 3}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    ok = requests.post(f"{s.url}/v1/chat/completions", json={**body, "priority": 0}, timeout=60)
    assert ok.status_code == 200
