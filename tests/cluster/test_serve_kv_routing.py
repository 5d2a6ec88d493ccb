"""--router-mode kv through the real server (the shared app: two prefill replicas in P/D, two
colocated ones otherwise): events -> each replica's digest (and the router's own record of
what it sent where) -> the router's decision -> a prefix hit on the replica that holds the
history -> the same tokens as transformers."""

from __future__ import annotations

import time

from transformers import AutoTokenizer

from tests.cluster.helpers import SHARED_NAME, assert_no_leaks, metric_value, replicas, wait_for
from tests.engine.hf_reference import hf_greedy, random_prompts

# Sixteen full blocks of the shared app's block size: more than the load a replica can show for
# the first turns just sent to it (4 per request sent since its last report), so the history
# outweighs that load, as a real chat's history does.
HISTORY = 16 * 16


def _hits(app: str, role: str) -> float:
    return metric_value(app, "vllm:prefix_cache_hits_total", role=role)


def _reported_since(app: str, role: str, since: float) -> bool:
    reps = [r for r in replicas(app) if r["role"] == role]
    return len(reps) == 2 and all(r["time"] > since for r in reps)


def test_each_next_turn_goes_to_the_replica_that_holds_its_history(client, app, mode, shared_app, tiny_model):
    role = "prefill" if mode == "pd" else "colocated"
    histories = random_prompts([HISTORY] * 3, 1000, seed=77)
    firsts = [client.completions.create(model=SHARED_NAME, prompt=h, max_tokens=3, temperature=0) for h in histories]
    assert all(f.choices[0].finish_reason for f in firsts)
    # Engine figures reach /metrics with each replica's next report: the count before the
    # next turns is one from reports made after the first turns.
    since = time.time()
    wait_for(lambda: _reported_since(app, role, since), f"both {role} replicas to report", 30)
    hits = _hits(app, role)
    overlap = metric_value(app, "pdserve:router_decisions_total", reason="kv_overlap")
    seconds = [h + [11, 12, 13] for h in histories]  # each next turn: its history and more
    outs = [client.completions.create(model=SHARED_NAME, prompt=p, max_tokens=6, temperature=0) for p in seconds]
    # Sent at once, before any report could tell the routers: they went by what they sent.
    assert metric_value(app, "pdserve:router_decisions_total", reason="kv_overlap") == overlap + 3
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    expected = [tokenizer.decode(e, skip_special_tokens=True) for e in hf_greedy(tiny_model, seconds, 6)]
    assert [o.choices[0].text for o in outs] == expected
    # Every next turn found its whole history cached where it was sent.
    since = time.time()
    wait_for(lambda: _reported_since(app, role, since), f"both {role} replicas to report", 30)
    assert _hits(app, role) - hits == 3 * HISTORY
    held = [r["kv_cached_blocks"] for r in replicas(app) if r["role"] == role]
    assert sum(h["device"] for h in held) >= 3 * HISTORY // 16
    # Each engine's host tier took the histories' blocks too (write-through), and says so.
    assert sum(h["host"] for h in held) >= 3 * HISTORY // 16
    assert metric_value(app, "pdserve:kv_offload_stores_total", role=role) >= 3 * HISTORY // 16
    assert_no_leaks(app, shared_app.name, shared_app.roles)
