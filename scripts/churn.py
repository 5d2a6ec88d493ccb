"""Churn: SIGKILL a random engine replica or engine core process every --every-s seconds while
client threads keep a P/D app busy, then check what churn must not break (docs/operations.md#churn):

- no wrong 200: every answer equals the greedy oracle (the healthy server's, or run_churn's);
- every failure is a 5xx with Retry-After, or a retry (of the same request) that succeeded; no
  4xx, no client timeout (a request the server held for --request-timeout-s: a hang);
- no leak afterwards: every replica reports all its KV blocks free, nothing running, no prompt
  KV held, and the KV store holds no transfer (GET /status);
- each long-lived process (alive, the same process doing the same job, from the end of the
  warm-up to the end) keeps its RSS within RSS_GROWTH x its warm-up RSS + RSS_SLACK_MIB.

Victims are found through Serve: the `processes()` of each engine deployment (the Ingress too
with direct streaming, where it is the decode replica) names the replica's pid and its engine
cores'; nothing is killed by name. Linux only (/proc), and one node: the pids are this node's.

    python scripts/churn.py                                  # its own app on local Ray, 10 minutes
    python scripts/churn.py --minutes 2 --every-s 20 --clients 4 --model PATH
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# After the path set-up above, so the script runs from any directory.
from scripts.serve_bench.churn_requests import KINDS, PROMPTS, ask, check_oracle, openai_client  # noqa: E402, F401
from scripts.serve_bench.proc_cpu import classify, snapshot  # noqa: E402

# Long-lived processes may grow this much after warm-up: allocator and import caches settle, and
# a Serve controller or proxy keeps a little per replica it has seen (each kill adds one).
RSS_GROWTH = 1.25
RSS_SLACK_MIB = 64.0
RECOVER_S = 300.0  # after the load stops: every role back, clean, within this


@dataclasses.dataclass
class Tally:
    """What the clients saw. An attempt's failure kinds: its HTTP status (`503+retry-after`
    with the header), `stream-error` (an error event after the 200 headers), `connection`
    (refused, reset: a killed HTTP server), `timeout`."""

    requests: int = 0
    first_try: int = 0  # answered right at the first attempt
    retried_ok: int = 0  # failed at least once, then answered right
    failed: int = 0  # never answered within the retry budget
    wrong_200: int = 0
    attempt_failures: Counter = dataclasses.field(default_factory=Counter)
    # Kinds of failed attempts of requests that never succeeded (each must be a 503+Retry-After).
    unrecovered: Counter = dataclasses.field(default_factory=Counter)
    wrong: list = dataclasses.field(default_factory=list)  # (prompt index, text) of wrong 200s, a few
    examples: dict = dataclasses.field(default_factory=dict)  # kind -> the first such failure's message


def _kind(error: BaseException) -> str:
    import openai

    if isinstance(error, openai.APITimeoutError):
        return "timeout"
    if isinstance(error, openai.APIConnectionError):
        return "connection"
    if isinstance(error, openai.APIStatusError):
        code = error.status_code
        return f"{code}+retry-after" if code >= 500 and error.response.headers.get("retry-after") else str(code)
    if isinstance(error, openai.APIError):  # an error event in a stream (its 200 was sent)
        return "stream-error"
    return f"other:{type(error).__name__}"


class Clients:
    """`n` threads, each sending completions of each kind in `kinds` in turn (every other one
    streamed) until stopped, retrying a failed request (after its Retry-After, or a second) for
    up to `retry_s`. `oracle[(prompt index, kind)]` is each one's right text."""

    def __init__(self, url: str, model: str, oracle: dict, n: int, max_tokens: int, timeout_s: float,
                 retry_s: float, kinds: tuple[str, ...] = ("greedy",)) -> None:
        self.client = openai_client(url, timeout_s)
        self.model, self.oracle, self.max_tokens, self.retry_s = model, oracle, max_tokens, retry_s
        self.kinds = kinds
        self.tally, self._lock, self._stop = Tally(), threading.Lock(), threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(w,), name=f"churn-client-{w}", daemon=True)
                         for w in range(n)]

    def _one(self, i: int, stream: bool, kind: str) -> None:
        kinds: list[str] = []
        deadline = time.monotonic() + self.retry_s
        while True:
            try:
                text = ask(self.client, self.model, PROMPTS[i], self.max_tokens, stream, kind)
                break
            except Exception as e:  # noqa: BLE001 - every failure is classified and counted
                kinds.append(_kind(e))
                self.tally.examples.setdefault(kinds[-1], str(e)[:160])
                if kinds[-1].startswith("4") or time.monotonic() > deadline:  # a 4xx would only come again
                    text = None
                    break
                after = getattr(getattr(e, "response", None), "headers", {}).get("retry-after")
                time.sleep(float(after) if after else 1.0)  # the client's back-off, as the server asks
        with self._lock:
            t = self.tally
            t.requests += 1
            t.attempt_failures.update(kinds)
            if text is None:
                t.failed += 1
                t.unrecovered.update(kinds)
            elif text != self.oracle[i, kind]:
                t.wrong_200 += 1
                t.wrong = (t.wrong + [(i, kind, text)])[:5]
            elif kinds:
                t.retried_ok += 1
            else:
                t.first_try += 1

    def _run(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            self._one((worker + n) % len(PROMPTS), stream=n % 2 == 1, kind=self.kinds[n // 2 % len(self.kinds)])
            n += 1

    def __enter__(self) -> Clients:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.retry_s + 120)


def deployment_processes(deployment: str, app_name: str, timeout_s: float = 10.0) -> dict | None:
    """`processes()` of a replica of `deployment` (its pid and its engine cores'), or None while
    none answers (being replaced)."""
    from ray import serve

    try:
        return serve.get_deployment_handle(deployment, app_name).processes.remote().result(timeout_s=timeout_s)
    except Exception:  # noqa: BLE001 - no running replica right now: no victim there this round
        return None


def victims(app_name: str) -> list[tuple[str, str, int]]:
    """(deployment, "replica" | "core", pid) of every engine process a handle call reaches now.
    The Ingress counts only when it runs an engine (direct streaming)."""
    from ray import serve

    out = []
    for name in serve.status().applications[app_name].deployments:
        procs = None if name == "Coordinator" else deployment_processes(name, app_name)
        if procs is None or (name == "Ingress" and not procs["engine_cores"]):
            continue
        out.append((name, "replica", procs["replica"]))
        out += [(name, "core", pid) for pid in procs["engine_cores"]]
    return out


def _kill_one(app_name: str, rng: random.Random, tries: int = 5) -> dict | None:
    """SIGKILL one engine process picked at random; None when none could be (all being
    replaced). A pick that is gone by the kill (its replica just died with another) is picked
    again from a fresh list."""
    for _ in range(tries):
        candidates = victims(app_name)
        if not candidates:
            return None
        deployment, kind, pid = rng.choice(candidates)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        return {"deployment": deployment, "kind": kind, "pid": pid}
    return None


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def processes(root: int) -> dict[int, tuple[int, str, float]]:
    """pid -> (start ticks, command line, RSS MiB) of every process below `root`."""
    out = {}
    for pid, s in snapshot(root).items():
        rss = rss_mib(pid)
        if pid != root and rss is not None:
            out[pid] = (s.start_ticks, s.cmdline, rss)
    return out


def rss_report(warm: dict, end: dict) -> list[dict]:
    """Each process alive from warm-up to the end, the same process with the same command line
    (a Ray worker that became another actor meanwhile is a new job), with both RSS."""
    rows = []
    for pid, (start, cmd, rss) in warm.items():
        if pid in end and end[pid][:2] == (start, cmd):
            bound = RSS_GROWTH * rss + RSS_SLACK_MIB
            rows.append({"pid": pid, "role": classify(cmd), "title": cmd[:60], "warm_mib": round(rss, 1),
                         "end_mib": round(end[pid][2], 1), "bound_mib": round(bound, 1),
                         "ok": end[pid][2] <= bound})
    return sorted(rows, key=lambda r: -r["end_mib"])


def leaks(url: str, since: float) -> str | None:
    """None when every replica reported after `since` with all blocks free and nothing held,
    and the store has no transfer; else what is not so."""
    import requests

    status = requests.get(f"{url}/status", timeout=30).json()
    roles = [role for role in ("prefill", "decode", "colocated") if role in status.get("target", {})]
    for role in roles:
        fresh = [r for r in status.get(role, []) if r["time"] > since]
        if len(fresh) < status["target"][role]:
            return f"{role}: {len(fresh)} of {status['target'][role]} replicas reported since the load stopped"
        for r in fresh:
            if (r["free_blocks"], r["running"], r["waiting"], r["kv_handoffs"]) != (r["total_blocks"], 0, 0, 0):
                return f"{role} replica {r['replica']}: {r}"
    live = status.get("store", {}).get("live_transfers", 0)
    return f"the KV store holds {live} transfers" if live else None


def run_churn(url: str, app_name: str, model: str, duration_s: float, every_s: float, clients: int = 4,
              max_tokens: int = 16, warm_s: float = 10.0, seed: int = 0, root_pid: int | None = None,
              timeout_s: float = 120.0, retry_s: float = 240.0, log=print, oracle: list[str] | None = None,
              kinds: tuple[str, ...] = ("greedy",)) -> dict:
    """Measure, churn and check; the report as a dict (see the module's docstring). `oracle`:
    each of PROMPTS' right greedy text for `max_tokens` (default, and for the other `kinds`
    always: the healthy server's answers)."""
    import requests

    root = os.getpid() if root_pid is None else root_pid
    if oracle is not None and len(oracle) != len(PROMPTS):
        raise ValueError(f"oracle: one text per prompt ({len(PROMPTS)}), got {len(oracle)}")
    healthy = openai_client(url, timeout_s)
    right = {(i, kind): oracle[i] if oracle is not None and kind == "greedy" else
             ask(healthy, model, p, max_tokens, False, kind) for i, p in enumerate(PROMPTS) for kind in kinds}
    check_oracle(right)
    rng, kills = random.Random(seed), []
    with Clients(url, model, right, clients, max_tokens, timeout_s, retry_s, kinds) as load:
        time.sleep(warm_s)  # steady load before the first measure: the duration of the warm-up
        # What the end asks of the server (its /status, its /metrics), asked once before the
        # baseline: a first call's imports are not growth (a loaded machine may take a while).
        for route in ("status", "metrics"):
            requests.get(f"{url}/{route}", timeout=120)
        warm = processes(root)
        started = time.monotonic()
        while time.monotonic() - started < duration_s:
            kill = _kill_one(app_name, rng)
            if kill is not None:
                kills.append({"t_s": round(time.monotonic() - started, 1), **kill})
                log(f"[churn] t={kills[-1]['t_s']:.0f}s SIGKILL {kill['deployment']} {kill['kind']} pid {kill['pid']}")
            time.sleep(max(0.0, every_s - (time.monotonic() - started) % every_s))  # the churn period
    stopped, recovered = time.time(), None
    deadline = time.monotonic() + RECOVER_S
    while time.monotonic() < deadline:
        try:
            recovered = leaks(url, stopped)
        except Exception as e:  # noqa: BLE001 - an ingress being replaced: ask again
            recovered = f"/status: {e!r}"
        if recovered is None:
            break
        time.sleep(1.0)  # replicas report every routing-stats period; polled, bounded
    end = processes(root)
    t = load.tally
    from scripts.serve_bench.client import counters_by_reason

    # Prompts a decode replica prefilled for a prefill replica that could not, and requests
    # that went on on another engine replica when theirs died or hung.
    counted = counters_by_reason(url, {"pd_fallbacks": "pdserve:pd_fallback_total",
                                       "migrations": "pdserve:request_migrations_total"})
    rss = rss_report(warm, end)
    bad = {k: n for k, n in t.unrecovered.items() if not k.endswith("+retry-after")}
    bad.update({k: n for k, n in t.attempt_failures.items() if k.startswith("4") or k == "timeout"})
    report = {"duration_s": duration_s, "every_s": every_s, "clients": clients, "kinds": list(kinds), "kills": kills,
              "kills_by_kind": dict(Counter(f"{k['deployment']}:{k['kind']}" for k in kills)),
              "requests": t.requests, "first_try": t.first_try, "retried_ok": t.retried_ok, "failed": t.failed,
              "wrong_200": t.wrong_200, "wrong_examples": t.wrong, "attempt_failures": dict(t.attempt_failures),
              "failure_examples": t.examples,
              "unacceptable_failures": bad, **counted, "leak": recovered, "rss": rss,
              "rss_bound": f"end <= {RSS_GROWTH} x warm + {RSS_SLACK_MIB:g} MiB"}
    report["ok"] = (t.wrong_200 == 0 and not bad and recovered is None and all(r["ok"] for r in rss)
                    and t.requests > 0)
    return report


def _start_app(args) -> tuple[str, str]:
    """Local Ray, Serve's proxy on 127.0.0.1 and a P/D app with direct streaming whose engine
    cores run in processes of their own; the base URL and the served model's name."""
    from cluster.launch.app import build_app
    from cluster.launch.app_config import AppConfig
    from engine import EngineArgs
    from engine.models.default_model import default_model
    from scripts.serve_bench.server import free_port, local_ray

    local_ray(args.num_cpus)
    from ray import serve  # after local_ray: Serve reads the environment it set when imported

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    engine = EngineArgs(model=args.model or default_model(), engine_core_process=True,
                        max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks)
    cfg = AppConfig(engine_args=engine, mode="pd", served_model_name="churn", app_name=args.app_name,
                    direct_streaming=getattr(args, "direct_streaming", True), replica_num_cpus=0, health_check_period_s=1.0,
                    decode_replicas=args.decode_replicas)
    serve.run(build_app(cfg), name=args.app_name, route_prefix="/", blocking=False, external_scaler_enabled=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while not _healthy(url):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health not 200 within 600 s (Serve's logs: /tmp/ray/session_latest/logs/serve)")
        time.sleep(1.0)  # replicas starting: polled, bounded
    return url, "churn"


def _healthy(url: str) -> bool:
    from scripts.serve_bench.client import http_get

    try:
        return http_get(f"{url}/health", timeout_s=5.0)[0] == 200
    except OSError:
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--every-s", type=float, default=30.0, help="seconds between two kills")
    p.add_argument("--clients", type=int, default=4, help="client threads")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--warm-s", type=float, default=20.0, help="load before the RSS baseline and the first kill")
    p.add_argument("--seed", type=int, default=0, help="of the victims' choice")
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--num-kv-blocks", type=int, default=256)
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--decode-replicas", type=int, default=1, help="2 or more: a killed one's requests migrate")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"request kinds, comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--app-name", default="churn")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "churn.json"), help="the report, as JSON")
    args = p.parse_args()
    url, model = _start_app(args)
    try:
        report = run_churn(url, args.app_name, model, args.minutes * 60, args.every_s, args.clients,
                           args.max_tokens, args.warm_s, args.seed, kinds=tuple(args.kinds.split(",")))
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()  # the Ray this script started, and every process of it
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    summary = {k: v for k, v in report.items() if k not in ("kills", "rss")}
    print(json.dumps(summary, indent=2))
    for r in report["rss"]:
        print(f"  {r['role']:<18} pid {r['pid']:>7}  warm {r['warm_mib']:>7.1f} MiB  end {r['end_mib']:>7.1f} MiB"
              f"  {'ok' if r['ok'] else 'OVER ' + str(r['bound_mib'])}")
    print(("PASS" if report["ok"] else "FAIL") + f": report in {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
