"""`pdserve serve` as it runs and is stopped in production: in its own session, behind HAProxy.

- Clients that leave mid-stream stall nobody else's stream (the ingress's per-replica
  subscription must not belong to the request that opened it: Serve cancels a leaving client's
  calls, cluster/replica/replica_streams.py).
- Stopped with a streamed request in flight, by SIGTERM to the main process (docker,
  Kubernetes) or to the whole process group (`kill -- -PGID`): the stream finishes, then every
  process that was below the server is gone within --shutdown-timeout-s and nothing listens on
  its port any more."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest
import requests

from tests.cluster.helpers import (
    cmdline,
    free_port,
    listeners,
    proc_stat,
    process_tree,
    running,
    wait_for,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BOUND_S = 30.0  # --shutdown-timeout-s, the default
STREAM_TOKENS = 384  # long enough to be in flight at the signal on a loaded machine (at 128 a
# 2-core machine under load once finished the stream before the signal), short enough for the drain
# Tokens the stream has received when the signal is sent: the request is in the decode phase.
TOKENS_AT_SIGNAL = 4


class Stream(threading.Thread):
    """A streamed completion of exactly STREAM_TOKENS tokens; `started` is set once it has
    TOKENS_AT_SIGNAL tokens (or ended), and `on_started` runs then, on the reading thread, before
    it reads on: whatever the machine's scheduling, it runs with the stream in flight."""

    def __init__(self, url: str, model: str, on_started=None):
        super().__init__(daemon=True)
        self.url, self.model, self.on_started = url, model, on_started
        self.started = threading.Event()
        self.tokens, self.finish_reason, self.done, self.error = 0, None, False, None
        self.tokens_at_start = None

    def run(self) -> None:
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": STREAM_TOKENS,
                "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        try:
            with requests.post(f"{self.url}/v1/completions", json=body, stream=True, timeout=120) as r:
                r.raise_for_status()
                for line in r.iter_lines(decode_unicode=True):
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[len("data: "):])
                        self.tokens = chunk["usage"]["completion_tokens"]
                        for choice in chunk["choices"]:
                            self.finish_reason = choice.get("finish_reason") or self.finish_reason
                        if self.tokens >= TOKENS_AT_SIGNAL and not self.started.is_set():
                            self.tokens_at_start = self.tokens
                            if self.on_started is not None:
                                self.on_started()
                            self.started.set()
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = repr(e)
        finally:
            self.started.set()


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    port: int
    log: str
    tree: dict[int, str]  # the server itself and every process below it once it answered


@pytest.fixture
def server(tiny_model, tmp_path):
    """start(mode) -> Server: `pdserve serve` in a session of its own, once /health answers;
    anything of it still running at the end is killed."""
    started: list[Server] = []

    def start(mode: str) -> Server:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["PYTHONPATH"] = REPO
        log = str(tmp_path / f"serve-{mode}.log")
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "cluster.launch.cli", "serve", "--model", tiny_model, "--mode", mode,
                 "--host", "127.0.0.1", "--port", str(port), "--shutdown-timeout-s", str(BOUND_S),
                 "--max-model-len", "512", "--num-kv-blocks", "64"],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        srv = Server(proc, f"http://127.0.0.1:{port}", port, log, {proc.pid: proc_stat(proc.pid)[19]})
        started.append(srv)

        def healthy():
            assert proc.poll() is None, f"the server exited early:\n{_tail(log)}"
            try:
                return requests.get(f"{srv.url}/health", timeout=5).status_code == 200
            except requests.RequestException:
                return False

        wait_for(healthy, "the server to answer /health", 240, 0.5)
        srv.tree.update(process_tree(proc.pid))
        return srv

    yield start
    for srv in started:
        for pid, start_time in {**srv.tree, **process_tree(srv.proc.pid)}.items():
            if running(pid, start_time):
                os.kill(pid, signal.SIGKILL)
        srv.proc.wait(timeout=30)


def _tail(path: str, n: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


# SIGINT and SIGHUP to the main process take the same handler as SIGTERM (tests/cluster/
# test_shutdown.py runs all three on a stand-in); SIGTERM is the one Ray's init replaces.
@pytest.mark.parametrize("mode,stop", [
    ("colocated", "SIGTERM to the main process"),
    ("pd", "SIGTERM to the process group"),
])
def test_leaving_clients_stall_no_stream_and_the_stop_path_drains_then_ends_every_process(
        server, tiny_model, mode, stop):
    srv = server(mode)
    assert_a_client_leaving_stalls_no_other_stream(srv.url, os.path.basename(tiny_model))
    # The server's processes are looked at before the stream that the signal must catch in
    # flight starts: on a busy machine these /proc scans took longer than its tokens.
    srv.tree.update(process_tree(srv.proc.pid))
    replicas = [pid for pid in srv.tree if "ServeReplica" in cmdline(pid)]
    # Direct streaming (the default): P/D: ingress with its decode engine, prefill, coordinator;
    # colocated: ingress with its engine, coordinator. The engine core is the ingress's child.
    assert len(replicas) == (3 if mode == "pd" else 2), [cmdline(p) for p in srv.tree]
    [ingress] = [pid for pid in replicas if "Ingress" in cmdline(pid)]
    assert any(int(proc_stat(pid)[1]) == ingress for pid in srv.tree if proc_stat(pid)), "no engine core"
    # The HTTP port is HAProxy's (cluster/launch/http_proxy.py): the streams reached us through it. Serve
    # reloads HAProxy when its targets change (a new process takes the socket over, `-sf OLD`), so
    # one look can fall between the two owners: look again, bounded.
    deadline = time.monotonic() + 10
    while not any("haproxy" in owner for owner in listeners(srv.port)):
        assert time.monotonic() < deadline, f"port {srv.port} is not HAProxy's: {listeners(srv.port)}"
        time.sleep(0.1)
    # Every Ray process blocks SIGTERM (inherited from the node pdserve starts), so a group
    # SIGTERM reaches only the driver, which drains. HAProxy sets its own mask; it has a
    # process group of its own here (its manager's), as Serve's workers do.
    for pid in srv.tree:
        if running(pid, srv.tree[pid]) and pid != srv.proc.pid and "haproxy" not in cmdline(pid):
            assert sigterm_blocked(pid), f"{cmdline(pid)[:80]} neither blocks nor ignores SIGTERM"
    names = {pid: cmdline(pid) for pid in srv.tree}  # to say which ones went, should the stream fail
    sent = []

    def send_the_signal() -> None:  # on the stream's thread, as its TOKENS_AT_SIGNAL-th token arrives
        sent.append(time.monotonic())
        if stop == "SIGINT to the main process":
            srv.proc.send_signal(signal.SIGINT)
        elif stop == "SIGTERM to the main process":
            srv.proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(srv.proc.pid, signal.SIGTERM)

    stream = Stream(srv.url, os.path.basename(tiny_model), on_started=send_the_signal)
    stream.start()
    assert stream.started.wait(120) and stream.error is None and sent, stream.error
    tokens_at_signal, t0 = stream.tokens_at_start, sent[0]
    stream.join(BOUND_S)
    assert tokens_at_signal < STREAM_TOKENS  # the signal came mid-stream ...
    assert (stream.error, stream.done, stream.tokens, stream.finish_reason) == (None, True, STREAM_TOKENS, "length"), (
        f"{tokens_at_signal} tokens at the signal; gone by now: "
        f"{[names[p][:80] for p in srv.tree if not running(p, srv.tree[p])]}\n{_tail(srv.log)}")
    left = wait_for_gone(srv.tree, t0 + BOUND_S)
    took = time.monotonic() - t0
    assert not left, f"still running {took:.1f} s after {stop}: {[cmdline(p) for p in left]}\n{_tail(srv.log)}"
    assert srv.proc.wait(timeout=5) == 0, _tail(srv.log)  # 0: the drain finished, nothing was cut short
    # A socket outlives its process by the moment the kernel takes to close it: poll, bounded.
    deadline = time.monotonic() + 10
    while listeners(srv.port) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not listeners(srv.port)
    print(f"{mode}, {stop}: {len(srv.tree)} processes, all gone {took:.1f} s after the signal")


def assert_a_client_leaving_stalls_no_other_stream(url: str, model: str) -> None:
    """The first request on a fresh server opens the ingress's subscription to its engine
    replica; three more streams join it; then the first client leaves. The three must still
    get every token (before the fix they stalled until the read timeout: the subscription was
    the leaving request's child call, which Serve cancelled with it)."""
    def open_stream(max_tokens: int):
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        r = requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=60)
        r.raise_for_status()
        lines = r.iter_lines(decode_unicode=True)
        return r, lines, [next(line for line in lines if line.startswith("data: "))]

    leaving = open_stream(400)
    others = [open_stream(256) for _ in range(3)]
    leaving[0].close()  # the client goes away mid-stream
    texts = []
    for r, lines, events in others:  # every read is bounded by the 60 s timeout above
        events += [line for line in lines if line.startswith("data: ")]
        r.close()
        assert events[-1] == "data: [DONE]", events[-3:]
        chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 256
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        texts.append("".join(c["choices"][0]["text"] for c in chunks if c["choices"]))
    assert texts[0] and texts.count(texts[0]) == 3  # greedy: the same prompt, the same text


def sigterm_blocked(pid: int) -> bool:
    """SIGTERM cannot stop the process: blocked, or ignored (multiprocessing's resource
    tracker, started beside an engine core process, sets SIGTERM to SIG_IGN itself)."""
    with open(f"/proc/{pid}/status") as f:
        masks = {k: int(v.split()[0], 16) for k, v in (line.split(":", 1) for line in f)
                 if k in ("SigBlk", "SigIgn")}
    return bool((masks["SigBlk"] | masks["SigIgn"]) >> (signal.SIGTERM - 1) & 1)


def wait_for_gone(tree: dict[int, str], deadline: float) -> list[int]:
    """Poll (bounded by `deadline`) until no process of `tree` runs; returns those that still do."""
    left = list(tree)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [pid for pid in left if running(pid, tree[pid])]
    return left
