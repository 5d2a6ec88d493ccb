"""Decode migration behind Serve (docs/pd.md#decode-migration), on the P/D app with direct
streaming that this module shares with test_pd_fallback and others (`shared_direct_app`),
scaled to two decode (ingress) replicas for the test and back to one.

Six requests (greedy, seeded, JSON schema; each streamed and not) go to one ingress replica
(its own HTTP port); its engine core is SIGKILLed (or SIGSTOPped: hung, failed by the step
watchdog) once every stream is decoding. Each request
goes on on the other replica's engine: every answer is the healthy server's (greedy: Hugging
Face's), streamed chunks add up to it with no duplicate and no gap, usage counts every token,
and the migrations are counted. Then no block, request or transfer is left anywhere.
"""

from __future__ import annotations

import os
import signal

import pytest
import requests

from tests.cluster.helpers import DIRECT_APP as APP
from tests.cluster.helpers import DIRECT_NAME as NAME
from tests.cluster.helpers import (
    assert_no_leaks,
    deployment_processes,
    hf_text,
    in_thread,
    metric_value,
    replicas,
    wait_for,
)

ROLES = {"prefill", "decode"}
PROMPT = "The river ran quietly past"
MAX_TOKENS = 96
LONG_TEXT = {"type": "object", "properties": {"text": {"type": "string", "minLength": 150}}, "required": ["text"]}
BODIES = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 1.0, "top_p": 0.9, "seed": 11, "ignore_eos": True},
    "json": {"temperature": 1.0, "seed": 3, "max_tokens": 160,
             "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": LONG_TEXT}}},
}


@pytest.fixture(scope="module")
def app(shared_direct_app):
    return shared_direct_app.url()


def _body(kind: str) -> dict:
    return {"model": NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, **BODIES[kind]}


def _listening_ports(pid: int) -> list[int]:
    """The TCP ports process `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def _http_url(pid: int) -> str:
    """The base URL of an ingress replica's own HTTP server (Serve's direct ingress)."""
    for port in _listening_ports(pid):
        url = f"http://127.0.0.1:{port}"
        try:
            if requests.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return url
        except requests.RequestException:
            continue  # a gRPC port
    raise AssertionError(f"no HTTP port answers among {_listening_ports(pid)} of pid {pid}")


class _Stream:
    """A streamed completion read in a thread: its text chunks as they come, then its usage."""

    def __init__(self, url: str, body: dict) -> None:
        self.chunks: list[str] = []
        self.usage = self.error = None
        self.done = in_thread(self._read, url, {**body, "stream": True, "stream_options": {"include_usage": True}})

    def _read(self, url: str, body: dict) -> None:
        import json

        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=(10, 120)) as r:
            assert r.status_code == 200, r.text
            for line in r.iter_lines(decode_unicode=True):
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: "):])
                assert "error" not in event, event
                if event["choices"]:
                    self.chunks.append(event["choices"][0]["text"])
                if event.get("usage"):
                    self.usage = event["usage"]


# SIGKILL: the core dies (engine_died). SIGSTOP: it hangs, and the step watchdog fails it
# after DIRECT_STEP_TIMEOUT_S (engine_hung); the stopped process is killed at the end.
@pytest.mark.parametrize("sig,reason", [(signal.SIGKILL, "engine_died"), (signal.SIGSTOP, "engine_hung")],
                         ids=["killed", "stopped"])
def test_requests_on_a_killed_or_hung_decode_engine_go_on_on_the_other_decode_replica_as_if_healthy(
        app, tiny_model, sig, reason):
    healthy = {kind: requests.post(f"{app}/v1/completions", json=_body(kind), timeout=120).json()
               for kind in BODIES}
    expected = {kind: a["choices"][0]["text"] for kind, a in healthy.items()}
    assert expected["greedy"] == hf_text(tiny_model, PROMPT, MAX_TOKENS)
    assert len(expected["json"]) > 150  # long enough to be killed in the middle of
    before = {r: metric_value(app, "pdserve:request_migrations_total", reason=r)
              for r in ("replica_died", "engine_died", "engine_hung")}
    r = requests.post(f"{app}/scale", json={"decode": 2}, timeout=60)
    assert r.status_code == 202, r.text
    core = None
    try:
        wait_for(lambda: len([x for x in replicas(app) if x["role"] == "decode"]) == 2,
                 "both decode engines to report", 180, 0.5)
        seen: dict[int, dict] = {}

        def both():  # each call reaches either replica
            procs = deployment_processes("Ingress", APP)
            seen[procs["replica"]] = procs
            return len(seen) == 2
        wait_for(both, "processes() of both ingress replicas", 60, 0.1)
        victim = next(iter(seen.values()))
        url = _http_url(victim["replica"])
        streams = {kind: _Stream(url, _body(kind)) for kind in BODIES}
        plain = {kind: in_thread(lambda k: requests.post(f"{url}/v1/completions", json=_body(k), timeout=120), kind)
                 for kind in BODIES}
        # Every stream decoding on the victim's engine: its prefill's token and one chunk more.
        wait_for(lambda: all(len(s.chunks) >= 2 for s in streams.values()), "every stream to decode", 60, 0.01)
        core = victim["engine_cores"][0]
        os.kill(core, sig)
        for kind, s in streams.items():
            s.done.result(timeout=120)
            assert "".join(s.chunks) == expected[kind], kind
            assert s.usage == healthy[kind]["usage"], kind
        for kind, answer in plain.items():
            got = answer.result(timeout=120)
            assert got.status_code == 200, got.text
            assert got.json()["choices"][0]["text"] == expected[kind], kind
            assert got.json()["usage"] == healthy[kind]["usage"], kind
        # Counted on the victim, whose figures reach every scrape within a push period.
        def moved():
            now = {r: metric_value(app, "pdserve:request_migrations_total", reason=r) - before[r] for r in before}
            return now if now[reason] >= 3 else None
        moved = wait_for(moved, "the migrations to be counted", 30, 0.5)
        # The streams surely, and the plain requests beside them unless one ended first.
        others = [r for r in moved if r != reason]
        assert all(moved[r] == 0 for r in others) and 3 <= moved[reason] <= 6, moved
    finally:
        if sig == signal.SIGSTOP and core is not None:
            try:
                os.kill(core, signal.SIGKILL)  # failed by the watchdog, still stopped: not left behind
            except ProcessLookupError:
                pass
        back = requests.post(f"{app}/scale", json={"decode": 1}, timeout=60)
    assert back.status_code == 202, back.text

    def settled():
        s = requests.get(f"{app}/status", timeout=30).json()
        return not s["scaling"] and len(s["decode"]) == 1 and len(s["prefill"]) == 1
    wait_for(settled, "one decode replica again", 180, 0.5)
    assert_no_leaks(app, APP, ROLES)
