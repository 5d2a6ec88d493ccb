"""HTTP serving benchmark for an OpenAI-compatible server (pdserve's Ray Serve app).

Streams `POST /v1/completions` requests (temperature 0, EOS ignored, usage in the last chunk)
with synthetic prompts of random word counts and random output lengths, all seeded, and
reports per-request latency percentiles, throughput and goodput against TTFT/TPOT SLOs:

- TTFT: request sent -> first chunk carrying text; ITL: gaps between consecutive text chunks;
  TPOT: (E2E - TTFT) / (completion tokens - 1); E2E: request sent -> end of stream.
- goodput: successful requests/s that met both SLOs (--slo-ttft-ms, --slo-tpot-ms).

Arrivals are Poisson (--rate R requests/s) or a fixed number of closed-loop workers
(--concurrency C). Two warm-up requests go first and are not measured.

Against a running server:

    python scripts/bench_serve.py --url http://127.0.0.1:8000 [--served-model NAME] \\
        [--requests 200] [--rate 8 | --concurrency 16] [--json out.json]

P/D against colocated (the default when no --url is given): for each of --modes, start
`python -m cluster.cli serve --mode MODE` on a free port, wait for GET /health, run the same
workload, stop the server (SIGINT), then print both tables and the P/D / colocated ratios:

    python scripts/bench_serve.py [--compare] [--model DIR] [--num-kv-blocks N] \\
        [--server-args "--prefill-replicas 1 --decode-replicas 1"] [--requests 100 --rate 4]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

# Plain words for synthetic prompts; a random draw from them rarely shares long prefixes, so
# prefix caching does little across requests.
WORDS = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book
eye job word business issue side kind head house service friend father power hour game line
end member law car city community name president team minute idea kid body information back
parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education river stone garden window
light bridge market letter paper music table voice field road village winter summer autumn
spring ocean mountain forest island engine signal measure quiet bright simple careful green
yellow silver early later always never often rarely slowly quickly under over between across
before after during while because although however therefore perhaps certainly build carry
draw drive find follow give hold keep learn leave listen move open play read run speak stand
start stay take talk think travel turn wait walk watch write answer bring choose clean close
""".split()


class BenchError(RuntimeError):
    """A set-up problem (server unreachable, failed to start, bad flags) that ends the run."""


# ---------------------------------------------------------------------------------------------
# Workload

@dataclass
class WorkItem:
    prompt: str
    max_tokens: int


def make_workload(n: int, seed: int, input_len: tuple[int, int], output_len: tuple[int, int]) -> list[WorkItem]:
    """n prompts of random word counts in input_len and random max_tokens in output_len."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        words = rng.randint(*input_len)
        items.append(WorkItem(" ".join(rng.choice(WORDS) for _ in range(words)), rng.randint(*output_len)))
    return items


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets (s) of n requests: the first at 0, then exponential gaps of mean 1/rate."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"arrivals-{seed}")
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


# ---------------------------------------------------------------------------------------------
# Server-sent events

class SSEDecoder:
    """Splits a byte stream into the `data:` payloads of server-sent events.

    A `data:` line that is complete on its own (valid JSON or `[DONE]`, as OpenAI-style
    servers send) is emitted at once; otherwise data lines are joined and emitted at the blank
    line that ends the event, per the SSE format. Comments (`:`) and other fields are skipped.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._pending: list[str] = []

    def feed(self, data: bytes) -> list[str]:
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        out: list[str] = []
        for raw in lines:
            self._line(raw.rstrip(b"\r").decode("utf-8", errors="replace"), out)
        return out

    def flush(self) -> list[str]:
        """Payloads still held at the end of the stream."""
        out: list[str] = []
        if self._buf:
            self._line(self._buf.rstrip(b"\r").decode("utf-8", errors="replace"), out)
            self._buf = b""
        self._dispatch(out)
        return out

    def _line(self, line: str, out: list[str]) -> None:
        if not line:
            self._dispatch(out)
            return
        if not line.startswith("data:"):
            return  # comment, event:, id:, retry:
        value = line[5:]
        if value.startswith(" "):
            value = value[1:]
        if not self._pending and _complete_payload(value):
            out.append(value)
        else:
            self._pending.append(value)

    def _dispatch(self, out: list[str]) -> None:
        if self._pending:
            out.append("\n".join(self._pending))
            self._pending = []


def _complete_payload(value: str) -> bool:
    if value.strip() == "[DONE]":
        return True
    try:
        json.loads(value)
    except ValueError:
        return False
    return True


def chunk_error(chunk) -> str | None:
    """The message of an error event (`{"error": ...}` or `{"object": "error", ...}`), else None."""
    if not isinstance(chunk, dict):
        return f"unexpected stream chunk: {str(chunk)[:200]}"
    err = chunk.get("error")
    if err:
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    if chunk.get("object") == "error":
        return str(chunk.get("message") or chunk)
    return None


def chunk_text(chunk: dict) -> str:
    return "".join((c.get("text") or "") for c in chunk.get("choices") or [] if isinstance(c, dict))


# ---------------------------------------------------------------------------------------------
# Per-request records and their summary

@dataclass
class RequestRecord:
    ok: bool = False
    prompt_words: int = 0
    max_tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    start_s: float = 0.0  # send time, relative to the start of the run
    usage_missing: bool = False  # no usage chunk: completion_tokens counts text chunks instead
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tpot_s"] = self.tpot_s
        return d


def percentile(values, q: float) -> float | None:
    """q-th percentile (0..100) with linear interpolation between closest ranks; None if empty."""
    xs = sorted(values)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


PERCENTILES = (50, 90, 99)


def _stats_ms(values_s) -> dict:
    ms = [v * 1e3 for v in values_s]
    out = {"mean": sum(ms) / len(ms) if ms else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(ms, q)
    return out


def meets_slo(rec: RequestRecord, slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
    """A successful request whose TTFT and TPOT are within the SLOs (TPOT of 1-token outputs
    is undefined and counts as met)."""
    if not rec.ok or rec.ttft_s is None or rec.ttft_s * 1e3 > slo_ttft_ms:
        return False
    tpot = rec.tpot_s
    return tpot is None or tpot * 1e3 <= slo_tpot_ms


def summarise(records, slo_ttft_ms: float, slo_tpot_ms: float, duration_s: float) -> dict:
    """Latency percentiles (ms), throughputs and goodput of one run's per-request records.

    Latencies come from successful requests; ITL pools every gap of every request. Throughputs
    count successful requests and their completion tokens over duration_s; goodput counts the
    requests meeting both SLOs, and slo_attainment is their fraction of all requests.
    """
    records = list(records)
    ok = [r for r in records if r.ok]
    good = [r for r in records if meets_slo(r, slo_ttft_ms, slo_tpot_ms)]

    def per_s(n: int) -> float | None:
        return n / duration_s if duration_s > 0 else None

    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    errors = Counter(r.error or "unknown error" for r in records if not r.ok)
    return {
        "requests": len(records),
        "successful": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(out_tokens),
        "ttft_ms": _stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": _stats_ms([g for r in ok for g in r.itl_s]),
        "tpot_ms": _stats_ms([t for t in (r.tpot_s for r in ok) if t is not None]),
        "e2e_ms": _stats_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "good_requests": len(good),
        "goodput": per_s(len(good)),
        "slo_attainment": len(good) / len(records) if records else None,
        "usage_missing": sum(r.usage_missing for r in ok),
        "errors": dict(errors.most_common()),
    }


# ---------------------------------------------------------------------------------------------
# Load generation

def completion_payload(model: str, item: WorkItem) -> dict:
    return {
        "model": model,
        "prompt": item.prompt,
        "max_tokens": item.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _http_error_message(status: int, body: str) -> str:
    msg = body.strip()
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        msg = chunk_error(parsed) or str(parsed.get("detail") or msg)
    return f"HTTP {status}: {msg[:300]}" if msg else f"HTTP {status}"


class _StreamState:
    """What one response's stream has shown so far."""

    def __init__(self) -> None:
        self.text_stamps: list[float] = []
        self.first_chunk_t: float | None = None
        self.usage: dict | None = None
        self.done = False
        self.error: str | None = None

    def handle(self, payload: str, now: float) -> bool:
        """Take one SSE payload received at `now`; True when the stream is over."""
        if payload.strip() == "[DONE]":
            self.done = True
            return True
        try:
            chunk = json.loads(payload)
        except ValueError:
            self.error = f"malformed stream data: {payload[:200]}"
            return True
        self.error = chunk_error(chunk)
        if self.error:
            return True
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("choices") and self.first_chunk_t is None:
            self.first_chunk_t = now
        if chunk_text(chunk):
            self.text_stamps.append(now)
        return False

    def handle_all(self, payloads: list[str], now: float) -> bool:
        for payload in payloads:
            if self.handle(payload, now):
                return True
        return False


async def send_request(session, url: str, model: str, item: WorkItem, timeout_s: float,
                       t_run: float | None = None) -> RequestRecord:
    """Stream one completion and time it; failures end up in the record, never raised."""
    import aiohttp

    rec = RequestRecord(prompt_words=len(item.prompt.split()), max_tokens=item.max_tokens)
    decoder, st = SSEDecoder(), _StreamState()
    t0 = time.perf_counter()
    rec.start_s = t0 - t_run if t_run is not None else 0.0
    try:
        async with session.post(f"{url}/v1/completions", json=completion_payload(model, item),
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                rec.error = _http_error_message(resp.status, await resp.text(errors="replace"))
                rec.e2e_s = time.perf_counter() - t0
                return rec
            over = False
            async for data in resp.content.iter_any():
                over = st.handle_all(decoder.feed(data), time.perf_counter())
                if over:
                    break
            if not over:
                st.handle_all(decoder.flush(), time.perf_counter())
    except asyncio.TimeoutError:
        st.error = f"timeout after {timeout_s:g} s"
    except aiohttp.ClientError as e:
        st.error = f"{type(e).__name__}: {e}"
    rec.e2e_s = time.perf_counter() - t0
    rec.error = st.error
    if rec.error is None and not st.done:
        rec.error = "stream ended without [DONE]"
    if rec.error is not None:
        return rec

    rec.ok = True
    stamps = st.text_stamps
    start = stamps[0] if stamps else st.first_chunk_t
    rec.ttft_s = start - t0 if start is not None else None
    rec.itl_s = [b - a for a, b in zip(stamps, stamps[1:])]
    if st.usage:
        rec.prompt_tokens = int(st.usage.get("prompt_tokens") or 0)
        rec.completion_tokens = int(st.usage.get("completion_tokens") or 0)
    else:
        rec.usage_missing = True
        rec.completion_tokens = len(stamps)
    return rec


def _progress(done: int, total: int) -> None:
    if sys.stderr.isatty():
        end = "\n" if done == total else ""
        print(f"\r  {done}/{total} requests", end=end, file=sys.stderr, flush=True)


async def run_load(url: str, model: str, workload: list[WorkItem], *, rate: float | None,
                   concurrency: int | None, seed: int, timeout_s: float,
                   warmup: int = 2) -> tuple[list[RequestRecord], float]:
    """Warm up, then send the workload by Poisson arrivals (rate) or closed-loop workers
    (concurrency). (records in workload order, wall seconds of the measured part)."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        warm_items = make_workload(warmup, seed + 10_007, (8, 32), (4, 8))
        for item in warm_items:
            rec = await send_request(session, url, model, item, timeout_s)
            if not rec.ok:
                raise BenchError(f"warm-up request to {url} failed: {rec.error}")

        records: list[RequestRecord | None] = [None] * len(workload)
        finished = 0
        t_run = time.perf_counter()

        async def one(i: int) -> None:
            nonlocal finished
            records[i] = await send_request(session, url, model, workload[i], timeout_s, t_run)
            finished += 1
            _progress(finished, len(workload))

        if concurrency:
            next_index = 0

            async def worker() -> None:
                nonlocal next_index
                while next_index < len(workload):
                    i = next_index
                    next_index += 1
                    await one(i)

            await asyncio.gather(*(worker() for _ in range(min(concurrency, len(workload)))))
        else:
            tasks = []
            for i, at in enumerate(poisson_arrivals(len(workload), rate, seed)):
                delay = t_run + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
        wall = time.perf_counter() - t_run
    return [r for r in records if r is not None], wall


# ---------------------------------------------------------------------------------------------
# Small synchronous HTTP helpers (readiness, model list)

def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """(status, body) of GET url; HTTP error statuses are returned, connection errors raised."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", errors="replace")


def first_model_id(url: str) -> str:
    """The first model id listed by GET /v1/models."""
    try:
        status, body = http_get(f"{url}/v1/models", timeout_s=10.0)
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot reach server at {url}: {e}") from e
    if status != 200:
        raise BenchError(f"GET {url}/v1/models: {_http_error_message(status, body)}")
    try:
        models = json.loads(body).get("data") or []
        return str(models[0]["id"])
    except (ValueError, AttributeError, IndexError, KeyError, TypeError) as e:
        raise BenchError(f"GET {url}/v1/models: no model id in {body[:200]!r}") from e


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Server subprocess (compare mode)

def server_command(mode: str, port: int, model: str | None, num_kv_blocks: int | None,
                   served_model: str | None, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--mode", mode, "--port", str(port)]
    if model:
        cmd += ["--model", model]
    if num_kv_blocks is not None:
        cmd += ["--num-kv-blocks", str(num_kv_blocks)]
    if served_model:
        cmd += ["--served-model-name", served_model]
    return cmd + list(extra)


def _log_tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError as e:
        return f"(cannot read {path}: {e})"


class ServerProcess:
    """`pdserve serve` in its own process group, output to a log file."""

    def __init__(self, cmd: list[str], log_path: str) -> None:
        self.cmd, self.log_path = cmd, log_path
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
        self._log = open(log_path, "wb")  # closed in stop()
        try:
            self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=self._log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            self._log.close()
            raise BenchError(f"cannot start {cmd[0]}: {e}") from e

    def wait_ready(self, url: str, deadline_s: float) -> None:
        """Poll GET /health until 200; fail if the process exits or the deadline passes."""
        t_end = time.monotonic() + deadline_s
        last = "no answer yet"
        while time.monotonic() < t_end:
            code = self.proc.poll()
            if code is not None:
                raise BenchError(f"server exited with code {code} before it was ready; "
                                 f"log {self.log_path}:\n{_log_tail(self.log_path)}")
            try:
                status, body = http_get(f"{url}/health", timeout_s=2.0)
                if status == 200:
                    return
                last = f"HTTP {status} {body[:100]}"
            except OSError as e:  # refused / reset while starting
                last = str(e)
            time.sleep(1.0)
        raise BenchError(f"server not ready after {deadline_s:g} s ({last}); "
                         f"log {self.log_path}:\n{_log_tail(self.log_path)}")

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGINT, then SIGTERM/SIGKILL to its group if it does not exit in time."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    print(f"server did not exit {timeout_s:g} s after SIGINT; terminating",
                          file=sys.stderr)
                    self._signal_group(signal.SIGTERM)
                    try:
                        self.proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        self._signal_group(signal.SIGKILL)
                        self.proc.wait(timeout=10)
            self._signal_group(signal.SIGTERM)  # stragglers it left in its group
        finally:
            self._log.close()

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


# ---------------------------------------------------------------------------------------------
# Report

def _fmt(v, spec: str = ".1f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def format_summary(title: str, s: dict) -> str:
    lines = [f"== {title}: {s['requests']} requests ({s['successful']} ok, {s['failed']} failed) "
             f"in {_fmt(s['duration_s'], '.2f')} s",
             f"{'(ms)':<8} {'mean':>9} " + " ".join(f"{'p' + str(q):>9}" for q in PERCENTILES)]
    for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")):
        st = s[key]
        lines.append(f"{name:<8} {_fmt(st['mean']):>9} "
                     + " ".join(f"{_fmt(st[f'p{q}']):>9}" for q in PERCENTILES))
    slo = s["slo"]
    att = s["slo_attainment"]
    lines += [
        f"request throughput  {_fmt(s['request_throughput'], '.2f')} req/s",
        f"output throughput   {_fmt(s['output_throughput'], '.1f')} tok/s "
        f"({s['output_tokens']} output, {s['input_tokens']} prompt tokens)",
        f"goodput             {_fmt(s['goodput'], '.2f')} req/s: {s['good_requests']}/{s['requests']} "
        f"({_fmt(att * 100 if att is not None else None, '.1f')}%) met TTFT <= {slo['ttft_ms']:g} ms "
        f"and TPOT <= {slo['tpot_ms']:g} ms",
    ]
    if s["usage_missing"]:
        lines.append(f"note: {s['usage_missing']} responses had no usage chunk; their tokens are "
                     f"counted as text chunks")
    if s["errors"]:
        lines.append("failures:")
        lines += [f"  {n:>5} x {msg}" for msg, n in s["errors"].items()]
    return "\n".join(lines)


def _ratio(a, b) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


RATIO_KEYS = (("TTFT p50", ("ttft_ms", "p50")), ("TTFT p99", ("ttft_ms", "p99")),
              ("ITL p50", ("itl_ms", "p50")), ("req/s", ("request_throughput",)),
              ("tok/s", ("output_throughput",)), ("goodput", ("goodput",)))


def compare_ratios(pd: dict, colocated: dict) -> dict:
    """P/D / colocated for the headline metrics (None where undefined)."""
    def get(s, path):
        for k in path:
            s = s[k]
        return s
    return {name: _ratio(get(pd, path), get(colocated, path)) for name, path in RATIO_KEYS}


def format_ratios(ratios: dict) -> str:
    return "P/D / colocated: " + ", ".join(
        f"{k} {'x' + _fmt(v, '.2f') if v is not None else 'n/a'}" for k, v in ratios.items())


# ---------------------------------------------------------------------------------------------
# Driver

def bench_url(args, url: str, model: str, workload: list[WorkItem]) -> tuple[dict, list[RequestRecord]]:
    records, wall = asyncio.run(run_load(
        url, model, workload, rate=args.rate, concurrency=args.concurrency, seed=args.seed,
        timeout_s=args.timeout, warmup=args.warmup))
    return summarise(records, args.slo_ttft_ms, args.slo_tpot_ms, wall), records


def bench_mode(args, mode: str, workload: list[WorkItem], log_dir: str):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_command(mode, port, args.model, args.num_kv_blocks, args.served_model,
                         shlex.split(args.server_args or ""))
    log_path = os.path.join(log_dir, f"server-{mode}.log")
    print(f"\n[{mode}] starting: {shlex.join(cmd)}\n[{mode}] log: {log_path}", flush=True)
    server = ServerProcess(cmd, log_path)
    try:
        t0 = time.monotonic()
        server.wait_ready(url, args.startup_timeout)
        model = args.served_model or first_model_id(url)
        print(f"[{mode}] ready in {time.monotonic() - t0:.1f} s, model {model!r}; running", flush=True)
        return bench_url(args, url, model, workload)
    finally:
        server.stop(args.stop_timeout)


def _load_desc(args) -> str:
    arrivals = (f"concurrency {args.concurrency}" if args.concurrency
                else f"Poisson {args.rate:g} req/s")
    return (f"{args.requests} requests, {arrivals}, prompts {args.input_len_min}-{args.input_len_max} "
            f"words, outputs {args.output_len_min}-{args.output_len_max} tokens, seed {args.seed}")


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
    print(f"wrote {path}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = ap.add_argument_group("target")
    target.add_argument("--url", default=None, help="benchmark this running server (e.g. http://127.0.0.1:8000)")
    target.add_argument("--served-model", default=None,
                        help="model name in requests (default: first id of GET /v1/models)")
    target.add_argument("--compare", action="store_true",
                        help="start a server per --modes and compare them (the default without --url)")
    target.add_argument("--modes", default="pd,colocated", help="comma list of serve modes for --compare")
    target.add_argument("--model", default=None, help="--compare: model dir (default: the server's default)")
    target.add_argument("--num-kv-blocks", type=int, default=None, help="--compare: passed to the server")
    target.add_argument("--server-args", default="", help="--compare: extra `pdserve serve` flags in one string "
                        "(write --server-args=--flag for a single flag)")
    target.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for /health")
    target.add_argument("--stop-timeout", type=float, default=60.0, help="seconds after SIGINT before kill")
    target.add_argument("--log-dir", default=None, help="--compare: server logs (default: a temp dir)")

    load = ap.add_argument_group("workload")
    load.add_argument("--requests", type=int, default=100, help="measured requests")
    arrivals = load.add_mutually_exclusive_group()
    arrivals.add_argument("--rate", type=float, default=None,
                          help="Poisson arrivals, requests/s ('inf': all at once); default 4")
    arrivals.add_argument("--concurrency", type=int, default=None, help="closed-loop workers")
    load.add_argument("--input-len-min", type=int, default=32, help="prompt words, min")
    load.add_argument("--input-len-max", type=int, default=256, help="prompt words, max")
    load.add_argument("--output-len-min", type=int, default=32, help="max_tokens, min")
    load.add_argument("--output-len-max", type=int, default=128, help="max_tokens, max")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--warmup", type=int, default=2, help="unmeasured requests sent first")
    load.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, seconds")

    rep = ap.add_argument_group("report")
    rep.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    rep.add_argument("--slo-tpot-ms", type=float, default=100.0)
    rep.add_argument("--json", metavar="OUT", default=None, help="write summaries and records as JSON")
    return ap


def check_args(ap: argparse.ArgumentParser, args) -> None:
    if args.url and args.compare:
        ap.error("--url and --compare are exclusive")
    if args.rate is None and args.concurrency is None:
        args.rate = 4.0
    if args.rate is not None and not args.rate > 0:
        ap.error("--rate must be > 0")
    if args.concurrency is not None and args.concurrency < 1:
        ap.error("--concurrency must be >= 1")
    if args.requests < 1 or args.warmup < 0 or args.timeout <= 0:
        ap.error("--requests must be >= 1, --warmup >= 0, --timeout > 0")
    if not 1 <= args.input_len_min <= args.input_len_max:
        ap.error("need 1 <= --input-len-min <= --input-len-max")
    if not 1 <= args.output_len_min <= args.output_len_max:
        ap.error("need 1 <= --output-len-min <= --output-len-max")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in ("pd", "colocated")]
    if bad or not args.modes:
        ap.error(f"--modes: expected pd and/or colocated, got {args.modes}")
    if args.url:
        args.url = args.url.rstrip("/")


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    workload = make_workload(args.requests, args.seed, (args.input_len_min, args.input_len_max),
                             (args.output_len_min, args.output_len_max))
    config = dict(vars(args))

    if args.url:
        try:
            model = args.served_model or first_model_id(args.url)
            print(f"{args.url}, model {model!r}: {_load_desc(args)}", flush=True)
            summary, records = bench_url(args, args.url, model, workload)
        except BenchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(format_summary(args.url, summary))
        if args.json:
            _write_json(args.json, {"config": config, "model": model, "summary": summary,
                                    "records": [r.to_dict() for r in records]})
        return 0 if summary["successful"] else 1

    log_dir = args.log_dir or tempfile.mkdtemp(prefix="bench_serve_")
    os.makedirs(log_dir, exist_ok=True)
    print(f"compare {', '.join(args.modes)}: {_load_desc(args)}", flush=True)
    results, failures = {}, {}
    for mode in args.modes:
        try:
            summary, records = bench_mode(args, mode, workload, log_dir)
        except BenchError as e:
            print(f"[{mode}] error: {e}", file=sys.stderr)
            failures[mode] = str(e)
            continue
        results[mode] = {"summary": summary, "records": [r.to_dict() for r in records]}
        print(f"[{mode}] done: {summary['successful']}/{summary['requests']} ok", flush=True)

    print()
    for mode, res in results.items():
        print(format_summary(mode, res["summary"]))
        print()
    ratios = None
    if "pd" in results and "colocated" in results:
        ratios = compare_ratios(results["pd"]["summary"], results["colocated"]["summary"])
        print(format_ratios(ratios))
    for mode, msg in failures.items():
        print(f"{mode}: failed: {msg.splitlines()[0]}")
    if args.json:
        _write_json(args.json, {"config": config, "results": results, "failures": failures,
                                "ratios": ratios})
    ok = not failures and all(r["summary"]["successful"] for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
