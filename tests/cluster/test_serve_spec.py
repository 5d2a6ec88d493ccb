"""Speculative decoding through the Serve app as `pdserve serve` runs it: the engine that
speculates is the ingress's own (direct streaming), its core in a child process.

Three apps, asked one after the other the same questions (completions over token prompts
after which the tiny model loops, so runs of drafts are accepted; a stop string; a seeded
sampled completion; a chat; each plain and streamed, through the official openai client):
- P/D without speculation: what the other two must answer, field for field. It is the P/D
  app with direct streaming and engine cores in child processes that this module shares with
  test_churn, test_pd_fallback and test_serve_pd_direct (`shared_direct_app`), asked first,
  while it still runs;
- P/D with n-gram speculation on the decode replica: the shared app's config with
  speculation added (every prompt here disaggregated, engine cores in child processes);
- colocated with a draft model, the target itself: its greedy drafts are all accepted iff the
  draft's KV cache is right.
Oracles: Hugging Face `generate`, the app without speculation, the replicas' counters as
/metrics shows them, and the processes under the ingress replica.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import pytest
import requests

from tests.cluster.helpers import ENGINE, assert_no_leaks, cmdline, process_tree, replicas, wait_for
from tests.engine.hf_reference import hf_greedy, random_prompts

NAME = "tiny-spec"
K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
MAX_TOKENS = 24
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a river twice."}]
CHAT_TOKENS = 16
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
APPS = ("pd-plain", "pd-ngram", "colocated-draft")
SPECULATING = ("pd-ngram", "colocated-draft")
FIELDS = ("text", "tokens", "finish", "usage")


def _prompts() -> list[list[int]]:
    """Repeated random token prompts, after which the tiny random model falls into loops of its
    own (runs of all K n-gram drafts are accepted), and a plain random one."""
    loops = [random_prompts([n], 1000, seed=seed)[0] * 5 for n, seed in ((12, 15), (7, 15), (7, 9))]
    return [*loops, random_prompts([9], 1000, seed=6)[0]]


@dataclass
class Answers:
    """What one app answered, and what it showed after."""

    completions: list[dict]  # per prompt, from one request with them all: text, tokens, logprobs, finish
    streamed: list[dict]  # per prompt, streamed alone and reassembled (with usage)
    stopped: list[dict]  # a stop string inside the first output: plain, streamed
    chat: dict
    chat_streamed: dict
    seeded: list[str]  # the same seeded sampled completion, twice
    spec_series: list  # the vllm:spec_decode_* samples on /metrics after the greedy requests
    core_processes: list[str]  # command lines of the processes spawned under the ingress replica
    leaks: str | None  # assert_no_leaks's failure, if any


def _reassemble(chunks) -> dict:
    parts = [c.choices[0] for c in chunks if c.choices]
    return {"text": "".join(c.text for c in parts),
            "tokens": [t for c in parts if c.logprobs for t in c.logprobs.tokens],
            "logprobs": [v for c in parts if c.logprobs for v in c.logprobs.token_logprobs],
            "finish": parts[-1].finish_reason,
            "usage": (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens)}


def _ask(url: str, name: str) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    prompts = _prompts()
    base = dict(model=name, max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
    stream = dict(stream=True, stream_options={"include_usage": True})
    # One request with every prompt (they decode in one batch), then each streamed alone. A
    # batch's usage is the sum: per prompt it is compared streamed.
    whole = client.completions.create(prompt=prompts, **base)
    completions = [{"text": c.text, "tokens": c.logprobs.tokens, "logprobs": c.logprobs.token_logprobs,
                    "finish": c.finish_reason, "usage": None} for c in sorted(whole.choices, key=lambda c: c.index)]
    streamed = [_reassemble(list(client.completions.create(prompt=p, **base, **stream))) for p in prompts]
    # A stop string from the middle of the first output: it may end inside an accepted run.
    text = completions[0]["text"]
    stop = [text[len(text) // 2:len(text) // 2 + 3]]
    r = client.completions.create(prompt=prompts[0], stop=stop, **base)
    stopped = [{"text": r.choices[0].text, "tokens": r.choices[0].logprobs.tokens,
                "logprobs": r.choices[0].logprobs.token_logprobs, "finish": r.choices[0].finish_reason,
                "usage": (r.usage.prompt_tokens, r.usage.completion_tokens)},
               _reassemble(list(client.completions.create(prompt=prompts[0], stop=stop, **base, **stream)))]
    chat_args = dict(model=name, messages=CHAT, max_tokens=CHAT_TOKENS, temperature=0)
    r = client.chat.completions.create(**chat_args)
    chat = {"text": r.choices[0].message.content, "finish": r.choices[0].finish_reason,
            "usage": (r.usage.prompt_tokens, r.usage.completion_tokens)}
    chunks = list(client.chat.completions.create(**chat_args, **stream))
    parts = [c.choices[0] for c in chunks if c.choices]
    chat_streamed = {"text": "".join(c.delta.content or "" for c in parts),
                     "finish": [c.finish_reason for c in parts if c.finish_reason][-1],
                     "usage": (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens)}
    return dict(completions=completions, streamed=streamed, stopped=stopped, chat=chat, chat_streamed=chat_streamed)


def _ask_seeded(url: str, name: str) -> list[str]:
    """The same seeded sampled completion, twice."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    return [client.completions.create(model=name, prompt=_prompts()[1], max_tokens=MAX_TOKENS, temperature=0.8,
                                      seed=7).choices[0].text for _ in range(2)]


def _spec_samples(url: str) -> list:
    """Every vllm:spec_decode_* sample on /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{url}/metrics", timeout=10).text
    return [s for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("vllm:spec_decode")]


def _total(samples: list, name: str, **labels) -> float:
    return sum(s.value for s in samples if s.name == f"vllm:spec_decode_{name}_total"
               and all(s.labels.get(k) == v for k, v in labels.items()))


def _scrape_after(url: str, roles: set[str], since: float) -> list:
    """/metrics's spec samples once every replica has reported since `since` (reports come with
    Serve's routing-stats rounds; /metrics and /status show the Coordinator's latest)."""
    wait_for(lambda: {r["role"] for r in replicas(url) if r["time"] > since} == roles, "reports after the requests", 30)
    return _spec_samples(url)


def _spawned_under_ingress(app_name: str) -> list[str]:
    """Command lines of the processes spawned by multiprocessing under the app's ingress replica
    (Ray titles an actor's process `ray::ServeReplica:<app>:<deployment>`)."""
    ingress = [int(p) for p in os.listdir("/proc") if p.isdigit()
               and cmdline(int(p)).startswith(f"ray::ServeReplica:{app_name}:Ingress")]
    return [c for root in ingress for c in map(cmdline, process_tree(root)) if "spawn_main" in c]


def _speculative_config(app: str, tiny_model: str) -> dict | None:
    if app == "pd-ngram":
        return NGRAM
    if app == "colocated-draft":
        return {"method": "draft_model", "model": tiny_model, "num_speculative_tokens": K}
    return None


@pytest.fixture(scope="module")
def answers(deploy, tiny_model, shared_direct_app) -> dict[str, Answers]:
    """Each app in turn (one at a time on two cores), asked and checked: the shared app without
    speculation first, then each speculating one deployed in its place."""
    from cluster.launch.app_config import AppConfig
    from engine import EngineArgs
    from tests.cluster.helpers import DIRECT_NAME

    out = {}
    for app in APPS:
        spec = _speculative_config(app, tiny_model)
        mode = app.split("-")[0]
        roles = {"prefill", "decode"} if mode == "pd" else {"colocated"}
        if spec is None:
            url, app_name, name = shared_direct_app.url(), shared_direct_app.name, DIRECT_NAME
        else:
            if mode == "pd":  # the shared app's config with speculation: nothing else differs
                base = shared_direct_app.config
                cfg = dataclasses.replace(base, engine_args=dataclasses.replace(base.engine_args, speculative_config=spec),
                                          served_model_name=NAME, app_name=f"spec-{app}")
            else:
                cfg = AppConfig(engine_args=EngineArgs(model=tiny_model, speculative_config=spec, **ENGINE),
                                mode=mode, served_model_name=NAME, app_name=f"spec-{app}", replica_num_cpus=0)
            url, app_name, name = deploy(cfg), cfg.app_name, NAME
        asked = _ask(url, name)
        # The counters of the greedy requests alone (the seeded one's drafts may be rejected).
        spec_series = _scrape_after(url, roles, time.time())
        seeded = _ask_seeded(url, name)
        try:
            assert_no_leaks(url, app_name, roles)
            leaks = None
        except AssertionError as e:
            leaks = str(e)
        out[app] = Answers(**asked, seeded=seeded, spec_series=spec_series,
                           core_processes=_spawned_under_ingress(app_name), leaks=leaks)
    return out


@pytest.fixture(scope="module")
def expected(tiny_model) -> dict:
    """Hugging Face greedy: text, finish reason and usage of each prompt and of the chat."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    chat_ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)

    def answer(ids, max_tokens):
        out = hf_greedy(tiny_model, [ids], max_tokens)[0]
        return {"text": tok.decode(out, skip_special_tokens=True),
                "finish": "length" if len(out) == max_tokens else "stop",
                "usage": (len(ids), len(out))}

    return {"completions": [answer(p, MAX_TOKENS) for p in _prompts()], "chat": answer(chat_ids, CHAT_TOKENS)}


@pytest.mark.parametrize("app", APPS)
def test_greedy_answers_equal_transformers_plain_and_streamed(answers, expected, app):
    got = answers[app]
    for plain, streamed, hf in zip(got.completions, got.streamed, expected["completions"], strict=True):
        assert (plain["text"], plain["finish"]) == (hf["text"], hf["finish"])
        assert (streamed["text"], streamed["finish"], streamed["usage"]) == (hf["text"], hf["finish"], hf["usage"])
    assert got.chat == got.chat_streamed == expected["chat"]


@pytest.mark.parametrize("app", SPECULATING)
def test_speculation_changes_nothing_the_client_sees(answers, app):
    """Texts, tokens, finish reasons, usage and logprobs equal the app without speculation's,
    a stop string inside an accepted run included."""
    got, plain = answers[app], answers["pd-plain"]
    assert plain.stopped[0]["finish"] == "stop"
    pairs = zip(got.completions + got.streamed + got.stopped, plain.completions + plain.streamed + plain.stopped,
                strict=True)
    for a, b in pairs:
        assert {k: a[k] for k in FIELDS} == {k: b[k] for k in FIELDS}
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)
    assert {k: got.stopped[0][k] for k in FIELDS} == {k: got.stopped[1][k] for k in FIELDS}  # streamed as plain
    assert (got.chat, got.chat_streamed) == (plain.chat, plain.chat_streamed)


@pytest.mark.parametrize("app", APPS)
def test_a_seeded_sampled_request_repeats(answers, app):
    first, again = answers[app].seeded
    assert first == again and first


@pytest.mark.parametrize("app", APPS)
def test_the_ingress_engine_core_runs_in_a_child_process_and_nothing_leaks(answers, app):
    assert len(answers[app].core_processes) == 1, answers[app].core_processes
    assert answers[app].leaks is None, answers[app].leaks


@pytest.mark.parametrize("app", SPECULATING)
def test_spec_counters_on_metrics_count_accepted_drafts(answers, app):
    samples = answers[app].spec_series
    # Only the replica that decodes speculates (a prefill replica never does).
    assert {s.labels["role"] for s in samples} == {"decode" if app.startswith("pd") else "colocated"}
    assert {s.labels["model_name"] for s in samples} == {NAME}
    spec = {key: _total(samples, key) for key in SPEC_COUNTERS}
    per_pos = [_total(samples, "num_accepted_tokens_per_pos", position=str(p)) for p in range(K)]
    assert spec["num_drafts"] <= spec["num_draft_tokens"] <= K * spec["num_drafts"]
    assert 0 < spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    # A draft is accepted only after every draft before it: per position, non-increasing; the
    # last position counts the verification steps that emitted a bonus token.
    assert sum(per_pos) == spec["num_accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True) and per_pos[K - 1] > 0


def test_the_target_as_its_own_draft_has_every_draft_accepted(answers):
    """In the engine's child process: the draft's KV (same block ids, written every step) is
    right iff a draft identical to the target is never rejected."""
    samples = answers["colocated-draft"].spec_series
    assert _total(samples, "num_accepted_tokens") == _total(samples, "num_draft_tokens") > 0


def test_the_app_without_speculation_shows_no_spec_series(answers):
    assert answers["pd-plain"].spec_series == []
