"""The Serve app in P/D mode on local Ray, driven by the official openai client and raw HTTP:
the P/D app with direct streaming and engine cores in child processes that this module shares
with test_churn, test_pd_fallback, test_serve_pd_direct and test_serve_spec
(`shared_direct_app`). (P/D apps whose prefill engine runs in its replica's own thread, the
default: test_serve_scale, test_serve_autoscale, test_serve_tp and the shared question-asking
app.)

Oracles: Hugging Face greedy generation (text and token counts), HF log-softmax (logprobs),
the OpenAI error shape, and the replicas' own KV figures (no leaked block or transfer).
"""

from __future__ import annotations

import asyncio
import math

import pytest
import requests
import torch

from tests.cluster import structured_checks
from tests.cluster.helpers import (
    DIRECT_APP,
    DIRECT_NAME,
    DIRECT_SHORT,
    ENGINE,
    assert_no_leaks,
    metric_value,
    sse_events,
    wait_for,
)
from tests.engine.hf_reference import _hf_model, hf_greedy

APP, NAME, SHORT = DIRECT_APP, DIRECT_NAME, DIRECT_SHORT
PROMPTS = ["The river ran quietly past", "A good engineer measures before", "Hello! How can I help you",
           "Once upon a time there was a small village by the sea where"]


@pytest.fixture(scope="module")
def app(shared_direct_app):
    # Prompts of at most SHORT tokens prefill on their decode replica; every other one is
    # disaggregated whatever the load (queue 0), so the P/D path is what the other tests test.
    return shared_direct_app.url()


@pytest.fixture(scope="module")
def client(app):
    from openai import OpenAI

    return OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def _hf_text(tiny_model, tokenizer, ids: list[int], max_tokens: int) -> tuple[str, int]:
    out = hf_greedy(tiny_model, [ids], max_tokens)[0]
    return tokenizer.decode(out, skip_special_tokens=True), len(out)


def test_models_and_health(app):
    assert requests.get(f"{app}/health", timeout=10).status_code == 200
    data = requests.get(f"{app}/v1/models", timeout=10).json()
    assert data["object"] == "list"
    # The served model first (the app is shared: what else it lists is not this test's).
    base = data["data"][0]
    assert (base["id"], base["object"], base["parent"]) == (NAME, "model", None)
    assert base["max_model_len"] == ENGINE["max_model_len"]


def test_completion_greedy_equals_hf(client, tiny_model, tokenizer):
    for prompt in PROMPTS:
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0)
        ids = tokenizer.encode(prompt)
        text, n = _hf_text(tiny_model, tokenizer, ids, 24)
        c = r.choices[0]
        assert c.text == text, prompt
        assert r.usage.prompt_tokens == len(ids)
        assert r.usage.completion_tokens == n
        assert r.usage.total_tokens == len(ids) + n
        assert c.finish_reason == ("length" if n == 24 else "stop")


def test_streamed_completion_matches_plain(client, app):
    prompt = PROMPTS[3]
    plain = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0)
    stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    # Raw: SSE framing ends with [DONE].
    r = requests.post(f"{app}/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 5,
                                                     "stream": True}, stream=True, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]" and all(isinstance(e, dict) for e in events[:-1])
    assert all("usage" not in e for e in events[:-1])  # only with include_usage


def test_streamed_deltas_reassemble_to_the_plain_result(client):
    """Per-step messages, accumulated in the ingress: for seeded sampling with logprobs and a
    stop string, over a batch of prompts (several choices interleaved in one stream), the
    streamed pieces join to exactly the plain response: text, tokens, logprobs, finish."""
    base = dict(model=NAME, prompt=PROMPTS, max_tokens=24, temperature=1.0, seed=5, logprobs=2)
    first = client.completions.create(**base)
    # A stop string the sampled text really contains (from the first, unstopped run).
    text0 = first.choices[0].text
    stop = text0[len(text0) // 2: len(text0) // 2 + 2]
    assert stop.strip()
    plain = client.completions.create(**base, stop=[stop])
    chunks = list(client.completions.create(**base, stop=[stop], stream=True))
    assert plain.choices[0].finish_reason == "stop"
    for choice in plain.choices:
        parts = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(p.text for p in parts) == choice.text
        tokens = [t for p in parts if p.logprobs for t in p.logprobs.tokens]
        lps = [v for p in parts if p.logprobs for v in p.logprobs.token_logprobs]
        assert tokens == choice.logprobs.tokens
        assert lps == pytest.approx(choice.logprobs.token_logprobs, abs=1e-4)
        assert parts[-1].finish_reason == choice.finish_reason


def test_chat_plain_and_streamed_equal_hf(client, tiny_model, tokenizer):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a river."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    text, n = _hf_text(tiny_model, tokenizer, ids, 16)
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == n
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.total_tokens == len(ids) + n


def test_concurrent_requests_each_equal_hf(app, tiny_model, tokenizer):
    from openai import AsyncOpenAI

    prompts = [f"{p} {i}" for i, p in enumerate(PROMPTS * 3)]
    expected = [_hf_text(tiny_model, tokenizer, tokenizer.encode(p), 12)[0] for p in prompts]

    async def run():
        client = AsyncOpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0)
        rs = await asyncio.gather(*[
            client.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0) for p in prompts])
        await client.close()
        return [r.choices[0].text for r in rs]

    assert asyncio.run(run()) == expected
    assert_no_leaks(app, APP, {"prefill", "decode"})


def test_batched_prompts_and_token_prompts(client, tiny_model, tokenizer):
    ids = tokenizer.encode(PROMPTS[0])
    r = client.completions.create(model=NAME, prompt=[PROMPTS[1], PROMPTS[2]], max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for c, p in zip(r.choices, PROMPTS[1:3]):
        assert c.text == _hf_text(tiny_model, tokenizer, tokenizer.encode(p), 8)[0]
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == _hf_text(tiny_model, tokenizer, ids, 8)[0]
    # n=2 over two prompts: choice index = prompt index * n + sample (vLLM's order), each greedy.
    r = client.completions.create(model=NAME, prompt=[PROMPTS[1], PROMPTS[2]], max_tokens=8, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [_hf_text(tiny_model, tokenizer, tokenizer.encode(p), 8)[0]
                                           for p in PROMPTS[1:3] for _ in range(2)]


def test_logprobs_match_hf(client, tiny_model, tokenizer):
    prompt = PROMPTS[1]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    ids = tokenizer.encode(prompt)
    gen = hf_greedy(tiny_model, [ids], 6)[0]
    model = _hf_model(tiny_model)
    with torch.no_grad():
        logits = model(torch.tensor([ids + gen])).logits[0, len(ids) - 1:-1]
    ref = torch.log_softmax(logits.float(), -1)
    assert len(lp.token_logprobs) == len(gen)
    for i, tid in enumerate(gen):
        assert math.isclose(lp.token_logprobs[i], ref[i, tid].item(), abs_tol=1e-3)
        assert len(lp.top_logprobs[i]) <= 3 + 1  # top 3 plus the sampled token
        assert lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i]
        assert max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i], abs=1e-5)  # greedy
    assert lp.text_offset[0] == 0
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_vllm_extra_fields(client, tiny_model, tokenizer):
    base = dict(model=NAME, prompt=PROMPTS[0], temperature=0)
    r = client.completions.create(**base, max_tokens=40, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 40 and r.choices[0].finish_reason == "length"
    r = client.completions.create(**base, max_tokens=30, extra_body={"min_tokens": 30, "ignore_eos": False})
    assert r.usage.completion_tokens == 30
    stop_id = hf_greedy(tiny_model, [tokenizer.encode(PROMPTS[0])], 1)[0][0]  # the first greedy token
    r = client.completions.create(**base, max_tokens=5, extra_body={"stop_token_ids": [stop_id]})
    # As in vLLM, a stop token that is not a special token stays in the text.
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    assert r.choices[0].text == tokenizer.decode([stop_id])
    sampled = dict(model=NAME, prompt=PROMPTS[2], max_tokens=16, temperature=1.0, seed=7,
                   extra_body={"top_k": 50, "min_p": 0.01})
    a = client.completions.create(**sampled).choices[0].text
    b = client.completions.create(**sampled).choices[0].text
    assert a == b  # seeded sampling is reproducible across requests (and across the P/D split)


BAD = [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": ENGINE["max_model_len"]}, "max_tokens"),  # prompt + max_tokens beyond the context
    ({"prompt": "word " * 600}, "prompt"),  # the prompt alone exceeds the context
    ({"top_k": -3}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"logprobs": 50}, "logprobs"),
    ({"n": 0}, "n"),
    ({"n": 200}, "n"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"prompt": None}, "prompt"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"1000000": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 21}, "logprobs"),
    ({"bad_words": [""]}, "bad_words"),
    ({"seed": 2**64}, "seed"),  # beyond the engine's 64-bit generators
    ({"top_k": 2**40}, "top_k"),
    ({"prompt": [-1, 5]}, "prompt"),  # token ids out of the vocabulary
    ({"prompt": [10**12]}, "prompt"),
    ({"prompt": []}, "prompt"),
]


@pytest.mark.parametrize("override,param", BAD, ids=[p for _, p in BAD])
def test_bad_completion_inputs_are_400_in_openai_shape(app, override, param):
    body = {"model": NAME, "prompt": "Hello there", "max_tokens": 4, **override}
    r = requests.post(f"{app}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_malformed_and_missing_fields_are_400(app):
    r = requests.post(f"{app}/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"},
                      timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = requests.post(f"{app}/v1/completions", json={"model": NAME}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = requests.post(f"{app}/v1/chat/completions", json={"model": NAME}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = requests.post(f"{app}/v1/chat/completions", json={"model": NAME, "messages": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = requests.post(f"{app}/v1/chat/completions", json={"model": NAME, "temperature": -1,
                                                          "messages": [{"role": "user", "content": "x"}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = requests.post(f"{app}/v1/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_unknown_model_is_404(app, client):
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert e.value.body["param"] == "model" or e.value.body.get("code") == "model_not_found"
    r = requests.post(f"{app}/v1/chat/completions", json={"model": "nope", "messages": [
        {"role": "user", "content": "x"}]}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("prompt", [PROMPTS[3], "Hi"], ids=["disaggregated", "prefilled-on-decode"])
def test_disconnect_mid_stream_aborts_both_sides(app, prompt):
    cancelled = metric_value(app, "pdserve:requests_total", status="cancelled")
    body = {"model": NAME, "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
    r = requests.post(f"{app}/v1/completions", json=body, stream=True, timeout=60)
    lines = r.iter_lines()
    got = 0
    for line in lines:
        if line.startswith(b"data: "):
            got += 1
            if got == 3:
                break
    r.close()  # the client goes away mid-stream
    assert_no_leaks(app, APP, {"prefill", "decode"})
    assert metric_value(app, "pdserve:requests_total", status="cancelled") == cancelled + 1


def test_metrics_exposes_latencies_and_replica_figures(app, client):
    client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count", "vllm:inter_token_latency_seconds_count"):
        assert metric_value(app, name, model_name=NAME) > 0, name
    text = requests.get(f"{app}/metrics", timeout=10).text
    for role in ("prefill", "decode"):
        assert f'vllm:kv_cache_usage_perc{{model_name="{NAME}",replica="{role}-' in text
        assert f'vllm:num_requests_waiting{{model_name="{NAME}",replica="{role}-' in text
    assert metric_value(app, "pdserve:kv_transfer_exports_total", role="prefill") > 0
    assert metric_value(app, "pdserve:kv_transfer_bytes_in_total", role="decode") > 0


def test_a_short_prompt_is_prefilled_and_decoded_on_one_decode_replica(app, client, tiny_model, tokenizer):
    ids = tokenizer.encode("Hi")
    assert len(ids) <= SHORT < len(tokenizer.encode(PROMPTS[0]))
    assert_no_leaks(app, APP, {"prefill", "decode"})  # reports made now, with every earlier export
    exports = metric_value(app, "pdserve:kv_transfer_exports_total", role="prefill")
    local = metric_value(app, "pdserve:local_prefills_total")
    expected, n = _hf_text(tiny_model, tokenizer, ids, 12)
    plain = client.completions.create(model=NAME, prompt="Hi", max_tokens=12, temperature=0)
    streamed = list(client.completions.create(model=NAME, prompt="Hi", max_tokens=12, temperature=0, stream=True))
    assert plain.choices[0].text == expected and plain.usage.completion_tokens == n
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected
    assert metric_value(app, "pdserve:local_prefills_total") == local + 2
    # Then one prompt over the prefill replica: once the replica's report shows its export, it
    # shows every export before it too (cumulative), and the short prompts made none.
    client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    wait_for(lambda: metric_value(app, "pdserve:kv_transfer_exports_total", role="prefill") >= exports + 1,
             "the prefill replica to report its export", 30, 0.2)
    assert metric_value(app, "pdserve:kv_transfer_exports_total", role="prefill") == exports + 1
    assert metric_value(app, "pdserve:local_prefills_total") == local + 2
    assert_no_leaks(app, APP, {"prefill", "decode"})


def test_null_fields_reused_ids_and_a_prompt_filling_the_context(app, tokenizer, tiny_model):
    base = {"model": NAME, "prompt": PROMPTS[0], "temperature": 0}
    # OpenAI clients send explicit nulls for unset fields.
    r = requests.post(f"{app}/v1/completions", json={**base, "max_tokens": 3, "n": None, "stream": None,
                                                     "presence_penalty": None, "echo": None}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    # The same client request_id twice at once: both answered, under that id.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        rs = list(pool.map(lambda _: requests.post(f"{app}/v1/completions", json={
            **base, "max_tokens": 20, "ignore_eos": True, "request_id": "same-id"}, timeout=60), range(2)))
    assert [x.status_code for x in rs] == [200, 200] and {x.json()["id"] for x in rs} == {"same-id"}
    # A prompt one token short of the context with max_tokens unset: exactly one token, as a
    # colocated engine gives (P/D must not send decode a prompt that fills the context).
    ids = (tokenizer.encode(" ".join(PROMPTS)) * 200)[: ENGINE["max_model_len"] - 1]
    r = requests.post(f"{app}/v1/completions", json={**base, "prompt": ids, "max_tokens": None,
                                                     "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1 and r.json()["choices"][0]["finish_reason"] == "length"


def test_structured_outputs_every_spelling_is_valid(client):
    structured_checks.check_every_spelling_constrains_sampled_completions(client, NAME)


def test_structured_outputs_chat_response_format(client):
    structured_checks.check_chat_response_format_plain_and_streamed(client, NAME)


def test_structured_outputs_bad_specs_are_400s(client, app):
    structured_checks.check_bad_specs_are_openai_400s_and_the_server_keeps_serving(client, app, NAME)


def test_structured_outputs_pd_equals_offline(client, tiny_model, app):
    structured_checks.check_equals_offline(client, NAME, tiny_model, ENGINE)
    assert_no_leaks(app, APP, {"prefill", "decode"})
