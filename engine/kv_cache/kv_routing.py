"""Precise KV-aware choice between engines (docs/kv_cache.md#kv-aware-routing): the one that
would prefill the fewest of a prompt's blocks, its load counted too.

Shared by every pool that chooses: a replica's data-parallel ranks (engine.dp) and the
cluster's request router (cluster.replica.router). Both hold a PrefixIndex of their
candidates and ask `rank` here; nothing here knows where the index came from.

Cost of a candidate = weight * (blocks it must compute + blocks it must load, a loaded block
costing a fraction of a computed one) + its load. The load is the router's usual score
(4 * waiting + running, engine.load.EngineLoad.score), in the same units as a block: a
16-token block of prefill weighs about one running request's decode step. A stale index only
costs a prefill: the engine computes what it does not find.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from engine.kv_cache.hashing import extend_block_hashes
from engine.kv_cache.prefix_index import Match

# What loading one block costs against computing it: a host-tier block is a memcpy (or an
# H2D copy), a shared-tier block a fetch from the object store.
HOST_BLOCK_COST = 0.1
SHARED_BLOCK_COST = 0.25
DEFAULT_OVERLAP_WEIGHT = 1.0


def prompt_block_hashes(prompt_token_ids: list[int], block_size: int, cache_salt: str | None = None,
                        lora_name: str | None = None, mm_features=None) -> list[bytes]:
    """The chained hashes of a prompt's full blocks, as its engine will compute them."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt_token_ids, block_size, cache_salt, mm_features, lora_name)
    return hashes


def prefill_cost(num_blocks: int, match: Match) -> float:
    """Blocks a candidate must compute, plus its loads at their fraction of a block. The
    prompt's last token is always computed, so a full match still costs a little."""
    return (num_blocks - match.blocks) + HOST_BLOCK_COST * match.host + SHARED_BLOCK_COST * match.shared


@dataclass(frozen=True)
class Choice:
    order: list  # candidate keys, best first
    reason: str  # "kv_overlap": the chosen one holds part of the prompt; "load": it holds none
    matched_blocks: int  # the chosen one's cached prefix


def rank(candidates: list[tuple[object, float]], match: Callable[[object], Match], num_blocks: int,
         weight: float = DEFAULT_OVERLAP_WEIGHT, rng: random.Random | None = None) -> Choice:
    """`candidates`: (key, load). Cheapest first; ties by load, then at random (`rng`) or in
    the given order (a caller that rotates it gets round robin), so idle replicas share the
    traffic that no cache decides."""
    matches = {k: match(k) for k, _ in candidates}

    def cost(c: tuple[object, float]) -> tuple:
        return (weight * prefill_cost(num_blocks, matches[c[0]]) + c[1], c[1], rng.random() if rng else 0)

    scored = sorted(candidates, key=cost)
    order = [k for k, _ in scored]
    best = matches[order[0]].blocks if order else 0
    return Choice(order, "kv_overlap" if best else "load", best)
