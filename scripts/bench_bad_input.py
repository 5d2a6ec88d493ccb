"""Oversized request bodies against a running server, with a canary: what each costs the
server, and what it costs everyone else.

Starts `pdserve serve` (the default model and mode unless told otherwise), then a canary
thread sends a 2-token chat every second for the whole run. After a quiet window (the canary's
usual latency), each oversized body is sent once, in turn:

  60,000 tools with tool_choice "none" (chat) and 60,000 function tools (Responses API),
  2,000,000 one-token prompts, 500,000 stop strings, 3,000,000 allowed_token_ids,
  200,000 bad words, 200,000 guided choices

and the script prints, per body: its size, the answer (status and `param`), seconds from the
moment the body was sent whole to the answer, and the canary's longest latency while it ran
next to its usual (median) one. At the end: the resident memory of the server's processes
before the first body and after the last (summed over its process tree, /proc).

    python scripts/bench_bad_input.py                     # the default model, P/D
    python scripts/bench_bad_input.py --mode colocated --model DIR

Linux only (/proc). Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.serve_bench.proc_cpu import snapshot  # noqa: E402
from scripts.serve_bench.server import ServerProcess, free_port, server_command  # noqa: E402

CANARY_PERIOD_S = 1.0


def _post(url: str, body: bytes, timeout_s: float) -> tuple[int, dict, float]:
    """(status, JSON answer, seconds from the body sent whole to the answer's status line)."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            status, text = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read()
    took = time.monotonic() - start  # urllib sends the whole body before it reads the answer
    try:
        return status, json.loads(text), took
    except ValueError:
        return status, {"raw": text[:200].decode(errors="replace")}, took


class Canary(threading.Thread):
    """A 2-token chat every CANARY_PERIOD_S; (sent at, latency) of each, failures as inf."""

    def __init__(self, url: str, model: str) -> None:
        super().__init__(daemon=True)
        self.url, self.model = url, model
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 2}).encode()
        while not self.stop.is_set():
            sent = time.monotonic()
            try:
                status, _, took = _post(f"{self.url}/v1/chat/completions", body, 300)
                latency = took if status == 200 else float("inf")
            except OSError:
                latency = float("inf")
            self.samples.append((sent, latency))
            self.stop.wait(max(0.0, CANARY_PERIOD_S - (time.monotonic() - sent)))

    def worst_between(self, start: float, end: float) -> float:
        """The longest latency of a canary request in flight at any time in [start, end]."""
        hit = [lat for sent, lat in self.samples if sent <= end and sent + lat >= start]
        return max(hit, default=0.0)


def bodies(model: str) -> list[tuple[str, str, dict]]:
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    return [
        ("60,000 tools, tool_choice none", "chat/completions",
         {**chat, "tools": [{**tool, "function": {**tool["function"], "name": f"f{i}"}} for i in range(60_000)],
          "tool_choice": "none"}),
        ("60,000 Responses tools", "responses",
         {"model": model, "input": "hi", "tools": [{"type": "function", "name": f"f{i}",
                                                    "parameters": {"type": "object"}} for i in range(60_000)]}),
        ("2,000,000 one-token prompts", "completions", {"model": model, "prompt": [[1]] * 2_000_000, "max_tokens": 1}),
        ("500,000 stop strings", "chat/completions", {**chat, "stop": [f"s{i}" for i in range(500_000)]}),
        ("3,000,000 allowed_token_ids", "chat/completions", {**chat, "allowed_token_ids": [1] * 3_000_000}),
        ("200,000 bad words", "chat/completions", {**chat, "bad_words": [f"w{i}" for i in range(200_000)]}),
        ("200,000 guided choices", "chat/completions", {**chat, "guided_choice": [f"c{i}" for i in range(200_000)]}),
    ]


def rss_mb(root: int) -> float:
    total = 0
    for pid in snapshot(root):
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
    return total / 2**20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="pd", choices=["pd", "colocated"])
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--quiet-s", type=float, default=15.0, help="canary-only window before the first body")
    args = p.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = f"/tmp/bench_bad_input-{port}.log"
    server = ServerProcess(server_command(args.mode, port, args.model, None, "m", []), log)
    try:
        server.wait_ready(url, 600)
        print(f"server up ({args.mode}, log {log}); canary every {CANARY_PERIOD_S:g} s", flush=True)
        canary = Canary(url, "m")
        canary.start()
        time.sleep(args.quiet_s)  # the canary's usual latency, on its own
        usual = statistics.median(lat for _, lat in canary.samples) if canary.samples else float("nan")
        before = rss_mb(server.proc.pid)
        print(f"canary usual latency {usual:.3f} s; server resident {before:.0f} MB\n")
        print(f"{'body':34} {'MiB':>6} {'answer':22} {'answer s':>9} {'canary worst s':>15}")
        for name, route, body in bodies("m"):
            data = json.dumps(body).encode()
            del body
            start = time.monotonic()
            status, answer, took = _post(f"{url}/v1/{route}", data, 300)
            end = time.monotonic()
            time.sleep(2 * CANARY_PERIOD_S)  # the canary requests in flight meanwhile finish
            param = (answer.get("error") or {}).get("param") if isinstance(answer, dict) else None
            print(f"{name:34} {len(data) / 2**20:6.1f} {f'{status} {param}':22} {took:9.2f} "
                  f"{canary.worst_between(start, end):15.2f}", flush=True)
        after = rss_mb(server.proc.pid)
        canary.stop.set()
        canary.join(timeout=310)
        print(f"\nserver resident: {before:.0f} MB before the first body, {after:.0f} MB after the last "
              f"({after - before:+.0f} MB)")
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
