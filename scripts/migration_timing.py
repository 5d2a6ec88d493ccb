"""Decode migration under a kill, timed: N greedy streams of M tokens on a P/D app with two
decode replicas; once every stream has K tokens, SIGKILL the engine of one decode replica, then
check that every stream completes with the healthy run's text and time each stream's wait for
its next token after the kill (docs/pd.md#decode-migration).

With direct streaming (the default) the decode replica is the ingress, which holds the clients'
connections, so what dies is its engine core process (`--kill core`); without it
(`--no-direct-streaming`) a whole decode replica can be killed (`--kill replica`). Either way
the streams that were on it go on on the other replica, which computes the KV of their prompt
and the tokens so far: the bound to compare with is a fixed allowance plus one prefill of the
sequence so far, measured afterwards on the same server (a 1-token request whose prompt is the
stream's prompt and text at the kill).

    python scripts/migration_timing.py                       # 8 streams x 128 tokens, the default model
    python scripts/migration_timing.py --kill replica --no-direct-streaming
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.churn import PROMPTS, _start_app, deployment_processes, openai_client  # noqa: E402

ALLOWANCE_S = 2.0  # the fixed part of the bound: noticing the death and placing the request again


class Stream(threading.Thread):
    """One greedy streamed completion; `chunks` holds (time, text) of every chunk with text."""

    def __init__(self, client, model: str, prompt: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.client, self.model, self.prompt, self.max_tokens = client, model, prompt, max_tokens
        self.chunks: list[tuple[float, str]] = []
        self.error: str | None = None

    def run(self) -> None:
        try:
            with self.client.completions.create(model=self.model, prompt=self.prompt, max_tokens=self.max_tokens,
                                                temperature=0, stream=True,
                                                extra_body={"ignore_eos": True}) as chunks:
                for c in chunks:
                    if c.choices and c.choices[0].text:
                        self.chunks.append((time.perf_counter(), c.choices[0].text))
        except Exception as e:  # noqa: BLE001 - reported
            self.error = f"{type(e).__name__}: {e}"[:200]

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.chunks)


def run_streams(client, model: str, prompts: list[str], max_tokens: int, kill=None, at_chunks: int = 0):
    """Every stream's record; `kill()` runs once every stream has `at_chunks` chunks (or ended),
    and its time is returned with them (None without a kill)."""
    streams = [Stream(client, model, p, max_tokens) for p in prompts]
    for s in streams:
        s.start()
    killed_at = None
    if kill is not None:
        deadline = time.monotonic() + 600
        while any(len(s.chunks) < at_chunks and s.is_alive() for s in streams):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the streams did not reach {at_chunks} chunks in 600 s")
            time.sleep(0.01)  # polling the clients' progress, bounded
        killed_at = kill()
    for s in streams:
        s.join(900)
    return streams, killed_at


def victim(app_name: str, kind: str) -> int:
    """The pid to kill: a decode replica's engine core (direct streaming), or the decode
    replica running the most requests (asked through Serve's handle, whose calls reach one
    replica or another: asked until both are known)."""
    from ray import serve

    if kind == "core":
        for _ in range(20):
            procs = deployment_processes("Ingress", app_name)
            if procs is not None and procs["engine_cores"]:
                return procs["engine_cores"][0]
        raise RuntimeError("no ingress replica with an engine core answered")
    handle = serve.get_deployment_handle("Decode", app_name)
    pids, running = {}, {}
    for _ in range(40):
        procs = handle.processes.remote().result(timeout_s=10)
        pids[procs["id"]] = procs["replica"]
        report = handle.report.remote().result(timeout_s=10)
        running[report.replica] = report.engine.running
        if len(pids) > 1 and set(pids) <= set(running):
            break
    busiest = max((r for r in running if r in pids), key=running.get)
    return pids[busiest]


def prefill_s(client, model: str, prompt: str) -> float:
    start = time.perf_counter()
    client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--kill-after", type=int, default=16, help="chunks every stream has at the kill")
    p.add_argument("--kill", choices=("core", "replica"), default="core")
    p.add_argument("--no-direct-streaming", dest="direct_streaming", action="store_false")
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--num-kv-blocks", type=int, default=256)
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--decode-replicas", type=int, default=2)
    p.add_argument("--app-name", default="migration")
    args = p.parse_args()
    if args.kill == "replica" and args.direct_streaming:
        p.error("--kill replica needs --no-direct-streaming: with direct streaming the decode replica is the "
                "ingress, and its death cuts its clients' connections")
    url, model = _start_app(args)
    try:
        client = openai_client(url, timeout_s=600)
        prompts = [PROMPTS[i % len(PROMPTS)] + f" (story {i})" for i in range(args.streams)]
        healthy, _ = run_streams(client, model, prompts, args.max_tokens)
        gap = max(b[0] - a[0] for s in healthy for a, b in zip(s.chunks, s.chunks[1:]))

        def kill() -> float:
            pid = victim(args.app_name, args.kill)
            os.kill(pid, signal.SIGKILL)
            return time.perf_counter()

        streams, killed_at = run_streams(client, model, prompts, args.max_tokens, kill, args.kill_after)
        rows = []
        for h, s in zip(healthy, streams):
            before = "".join(t for at, t in s.chunks if at <= killed_at)
            after = [at for at, _ in s.chunks if at > killed_at]
            wait = (after[0] - killed_at) if after else None
            rows.append({"same_text": s.error is None and s.text == h.text, "error": s.error,
                         "chunks": len(s.chunks), "next_token_after_kill_s": wait,
                         "prefill_so_far_s": prefill_s(client, model, s.prompt + before)})
        from scripts.serve_bench.client import http_get

        metrics = http_get(f"{url}/metrics", timeout_s=10)[1]
        migrations = [line for line in metrics.splitlines() if line.startswith("pdserve:request_migrations_total")]
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    print(f"{args.streams} streams x {args.max_tokens} tokens, {args.kill} of a decode replica killed at "
          f"{args.kill_after} chunks; longest gap between two chunks of the healthy run {gap:.3f} s")
    print("| stream | same text | next token after the kill s | prefill so far s | bound s | within |")
    print("| --- | --- | --- | --- | --- | --- |")
    ok = True
    for i, r in enumerate(rows):
        bound = ALLOWANCE_S + r["prefill_so_far_s"]
        wait = r["next_token_after_kill_s"]
        within = wait is not None and wait <= bound
        ok &= r["same_text"] and (within or wait is None and r["chunks"] <= args.kill_after)
        print(f"| {i} | {r['same_text']} | {'-' if wait is None else f'{wait:.3f}'} | {r['prefill_so_far_s']:.3f} "
              f"| {bound:.3f} | {within} |" + (f" {r['error']}" if r["error"] else ""))
    print("migrations: " + (json.dumps(migrations) if migrations else "none counted"))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
