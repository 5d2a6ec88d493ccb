"""The load generator: streamed completions timed per request, sent by Poisson arrivals or
closed-loop workers; plus the small synchronous HTTP helpers (readiness, model list)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from scripts.serve_bench import BenchError
from scripts.serve_bench.records import RequestRecord
from scripts.serve_bench.sse import SSEDecoder, chunk_error, chunk_text
from scripts.serve_bench.workload import WorkItem, make_workload, poisson_arrivals


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
        self.chunks = 0  # payloads carrying choices (a token may have no text yet: split UTF-8)
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
        if chunk.get("choices"):
            self.chunks += 1
            if self.first_chunk_t is None:
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
    rec.chunks = st.chunks
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


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """(status, body) of GET url; HTTP error statuses are returned, connection errors raised."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", errors="replace")


def engine_steps(url: str) -> dict[str, float]:
    """Forward passes so far of each engine role (`pdserve:engine_steps` on /metrics, summed
    over the role's replicas); {} when the server does not export them."""
    status, body = http_get(f"{url}/metrics", timeout_s=10.0)
    if status != 200:
        raise BenchError(f"GET {url}/metrics: HTTP {status} {body[:200]}")
    return steps_by_role(body)


def steps_by_role(metrics_text: str) -> dict[str, float]:
    steps: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "pdserve:engine_steps_total":
                role = sample.labels.get("role", "?")
                steps[role] = steps.get(role, 0.0) + sample.value
    return steps


def counters_by_reason(url: str, names: dict[str, str]) -> dict[str, dict[str, float]]:
    """{key: {reason: value}} of each counter `names[key]` on /metrics (summed over its other
    labels); every dict empty when /metrics does not answer."""
    out: dict[str, dict[str, float]] = {key: {} for key in names}
    try:
        status, body = http_get(f"{url}/metrics", timeout_s=30.0)
    except OSError:
        return out
    key_of = {name: key for key, name in names.items()}
    for family in text_string_to_metric_families(body if status == 200 else ""):
        for sample in family.samples:
            if sample.name in key_of:
                counts = out[key_of[sample.name]]
                reason = sample.labels.get("reason", "")
                counts[reason] = counts.get(reason, 0.0) + sample.value
    return out


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
