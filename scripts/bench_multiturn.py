"""Multi-turn chat against the server, router modes side by side in one run (the shape of
LMCache's multi-round QA and vLLM's multi-turn serving benchmark).

Sessions chat at once, each turn waiting for the last plus a think time: a shared system
prompt, user turns of fresh text, the history growing with every answer. Per router mode and
topology it reports TTFT (turn 1 and later turns), the share of prompt tokens the engines
found cached in turns >= 2 (usage.prompt_tokens_details, --enable-prompt-tokens-details) and
each routed replica's share of the prompt tokens looked up (vllm:prefix_cache_queries).

    python scripts/bench_multiturn.py [--model DIR] [--sessions 8] [--turns 4]
        [--modes kv,prefix-affinity,round-robin] [--topologies pd,colocated] [-- serve flags]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.serve_bench.client import http_get  # noqa: E402  (after the path set-up above)
from scripts.serve_bench.server import ServerProcess, free_port, server_command  # noqa: E402

WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "nu", "pe", "ri", "so", "tu") for b in "aeiou"] + [
    "river", "stone", "cloud", "paper", "window", "garden", "silver", "market", "winter", "forest"]


def machine_line() -> str:
    from kernels.cpu.build import level_in_use

    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    return f"CPU {cpu}, {os.cpu_count()} cores; pdserve's CPU kernels: ISA level {level_in_use()}"


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _queries_by_replica(url: str, role: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    _, text = http_get(f"{url}/metrics", timeout_s=30)
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:prefix_cache_queries_total" and s.labels.get("role") == role:
                out[s.labels["replica"]] = s.value
    return out


async def _session(client, model: str, system: str, rng: random.Random, args, records: list) -> None:
    messages = [{"role": "system", "content": system}]
    for turn in range(args.turns):
        messages.append({"role": "user", "content": _text(rng, args.user_words)})
        t0 = time.perf_counter()
        ttft, text, usage = None, [], None
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=args.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        details = usage.prompt_tokens_details
        records.append((turn, ttft if ttft is not None else time.perf_counter() - t0, usage.prompt_tokens,
                        details.cached_tokens if details is not None else 0))
        messages.append({"role": "assistant", "content": "".join(text)})
        await asyncio.sleep(args.think_s)  # the user reading: a workload property, not a wait


async def _run_sessions(url: str, args) -> list:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    rng = random.Random(args.seed)
    system = _text(rng, args.system_words)
    records: list = []
    await asyncio.gather(*(_session(client, model, system, random.Random(args.seed + 1 + i), args, records)
                           for i in range(args.sessions)))
    await client.close()
    return records


def run_one(topology: str, mode: str, args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    replicas = ["--prefill-replicas", "2", "--decode-replicas", "1"] if topology == "pd" else ["--replicas", "2"]
    extra = [*replicas, "--router-mode", mode, "--enable-prompt-tokens-details", "--host", "127.0.0.1",
             *args.serve_args]
    log = os.path.join(args.log_dir, f"multiturn-{topology}-{mode}.log")
    server = ServerProcess(server_command(topology, port, args.model, None, None, extra), log)
    try:
        server.wait_ready(url, 600)
        role = "prefill" if topology == "pd" else "colocated"
        before = _queries_by_replica(url, role)
        t0 = time.perf_counter()
        records = asyncio.run(_run_sessions(url, args))
        wall = time.perf_counter() - t0
        time.sleep(1.5)  # the replicas' next reports carry their counters to /metrics
        after = _queries_by_replica(url, role)
    finally:
        server.stop()
    queried = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    total = sum(queried.values()) or 1.0
    later = [r for r in records if r[0] >= 1]
    return {"topology": topology, "mode": mode, "wall_s": wall,
            "ttft1_p50": _pct([r[1] for r in records if r[0] == 0], 0.5),
            "ttft_p50": _pct([r[1] for r in later], 0.5), "ttft_p90": _pct([r[1] for r in later], 0.9),
            "cached": sum(r[3] for r in later) / max(1, sum(r[2] for r in later)),
            "prompt_tokens": sum(r[2] for r in records) / max(1, len(records)),
            "shares": sorted((v / total for v in queried.values()), reverse=True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory or .gguf (default: the default model)")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-words", type=int, default=220, help="about 300 tokens of the default model")
    p.add_argument("--user-words", type=int, default=150, help="about 200 tokens")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--think-s", type=float, default=0.5)
    p.add_argument("--modes", default="kv,prefix-affinity,round-robin")
    p.add_argument("--topologies", default="pd,colocated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("serve_args", nargs="*", help="more `pdserve serve` flags (after --)")
    args = p.parse_args()
    print(machine_line())
    print(f"{args.sessions} sessions x {args.turns} turns, system {args.system_words} words, user turns "
          f"{args.user_words} words, {args.max_tokens} tokens per answer, think {args.think_s} s")
    rows = [run_one(t, m, args) for t in args.topologies.split(",") for m in args.modes.split(",")]
    print(f"\n{'topology':<10} {'mode':<16} {'TTFT t1 p50':>11} {'TTFT t2+ p50':>12} {'p90':>7} "
          f"{'cached t2+':>10} {'replica shares':>16} {'prompt tok':>10} {'wall s':>7}")
    for r in rows:
        shares = "/".join(f"{s:.0%}" for s in r["shares"])
        print(f"{r['topology']:<10} {r['mode']:<16} {r['ttft1_p50']:>11.3f} {r['ttft_p50']:>12.3f} "
              f"{r['ttft_p90']:>7.3f} {r['cached']:>10.0%} {shares:>16} {r['prompt_tokens']:>10.0f} "
              f"{r['wall_s']:>7.1f}")
    for topology in args.topologies.split(","):
        by_mode = {r["mode"]: r for r in rows if r["topology"] == topology}
        if "kv" in by_mode:
            for other in by_mode:
                if other != "kv":
                    print(f"{topology}: kv p90 TTFT (turns >= 2) = "
                          f"{by_mode['kv']['ttft_p90'] / by_mode[other]['ttft_p90']:.2f}x {other}'s")


if __name__ == "__main__":
    main()
