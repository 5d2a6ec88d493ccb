"""Tensor-parallel P/D: every rank moves its own shard of a transfer.

A rank's KV cache holds only its heads, so a prefill replica of tp ranks exports one shard per
rank, and each decode rank loads the shards that hold its own heads (shard r at equal sizes;
kvstore.reshard for the others). Shard r of transfer T is a transfer of its own in the KV store,
named `shard_transfer_id(T, r)`; releasing T releases every shard of it (cluster-side flows
know only T), and once T is released no shard of it can register any more.
"""

from __future__ import annotations

_SEP = "#rank"


def shard_transfer_id(transfer_id: str, rank: int) -> str:
    return f"{transfer_id}{_SEP}{rank}"


def base_transfer_id(transfer_id: str) -> str:
    """The transfer a shard belongs to (a whole transfer is its own base)."""
    return transfer_id.split(_SEP, 1)[0]


def is_shard_of(transfer_id: str, base: str) -> bool:
    return transfer_id.startswith(base + _SEP)
