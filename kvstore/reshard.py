"""Re-sharding a prompt's KV by head when prefill and decode run different tensor-parallel sizes.

A prefill of `producer_tp` ranks exports one shard per rank (kvstore.shards; one whole transfer
when it has one rank), each holding the KV heads its rank's cache holds
(engine.models.parallel.kv_head_range). A decode rank needs the heads of its own split, so it
fetches the producer shards that hold them and joins their slices along the head axis:

    prefill tp 2 -> decode tp 1: rank 0 joins shard 0's heads and shard 1's;
    prefill tp 1 -> decode tp 2: rank r takes its half of the whole transfer;
    equal sizes: rank r takes shard r whole (no copy).

Any two sizes that each shard the model (check_tp_size) can be re-sharded: every head is held
by some producer rank. A shard is checked against the heads its producer rank holds before
anything is joined, so a shard of another model or split is refused by name
(kvstore.kv_io.MalformedKV), never joined into the wrong heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import ParameterError
from engine.models.parallel import kv_head_range
from kvstore.kv_io import MalformedKV, check_kv_layout
from kvstore.shards import shard_transfer_id


@dataclass(frozen=True)
class ShardPiece:
    """Heads [start, stop) of producer shard `shard` (None: the whole transfer of a one-rank
    prefill), in the shard's own head numbering."""

    shard: int | None
    start: int
    stop: int

    def transfer_id(self, transfer_id: str) -> str:
        return transfer_id if self.shard is None else shard_transfer_id(transfer_id, self.shard)


def check_pd_sizes(num_heads: int, num_kv_heads: int, sizes: dict[str, int]) -> None:
    """ParameterError naming the first field of `sizes` ({field: tensor-parallel size} of both
    P/D roles) that does not shard the model: it must divide `num_heads`, and divide
    `num_kv_heads` or be a multiple of it (fewer KV heads than ranks are replicated). Sizes that
    pass re-shard into each other, whatever they are."""
    both = " and ".join(f"{field}={tp}" for field, tp in sizes.items())
    for field, tp in sizes.items():
        if num_heads % tp:
            raise ParameterError(field, f"{both}: {field}={tp} does not divide num_attention_heads={num_heads}")
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ParameterError(
                field, f"{both}: the prompt's KV moves by KV head, and {field}={tp} neither divides "
                f"num_key_value_heads={num_kv_heads} nor is a multiple of it")


def plan_pieces(num_kv_heads: int, producer_tp: int, consumer_rank: int, consumer_tp: int) -> tuple[ShardPiece, ...]:
    """The slices of producer shards that make up consumer rank `consumer_rank`'s heads, in head
    order. A head replicated on several producer ranks is read from the one whose place in its
    group is nearest the consumer rank's (shard r at equal sizes), so the readers spread.
    MalformedKV("shape") if `producer_tp` holds some head on no rank (a size no engine runs)."""
    pieces: list[ShardPiece] = []
    for head in kv_head_range(consumer_rank, consumer_tp, num_kv_heads):
        holders = [s for s in range(producer_tp) if head in kv_head_range(s, producer_tp, num_kv_heads)]
        if not holders:  # a size check_tp_size refuses: some head is on no producer rank
            raise MalformedKV("shape", f"a prefill of tensor_parallel_size={producer_tp} does not split "
                                       f"{num_kv_heads} kv heads (kv head {head} is on none of its ranks)")
        shard = min(holders, key=lambda s: (abs(s * consumer_tp - consumer_rank * producer_tp), s))
        local = head - kv_head_range(shard, producer_tp, num_kv_heads).start
        name = None if producer_tp == 1 else shard
        if pieces and pieces[-1].shard == name and pieces[-1].stop == local:
            pieces[-1] = ShardPiece(name, pieces[-1].start, local + 1)
        else:
            pieces.append(ShardPiece(name, local, local + 1))
    return tuple(pieces)


def readers(num_kv_heads: int, producer_tp: int, consumer_tp: int) -> dict[int | None, int]:
    """How many consumer ranks read each producer shard that any reads (by `ShardPiece.shard`)."""
    counts: dict[int | None, int] = {}
    for rank in range(consumer_tp):
        for shard in {p.shard for p in plan_pieces(num_kv_heads, producer_tp, rank, consumer_tp)}:
            counts[shard] = counts.get(shard, 0) + 1
    return counts


def join_pieces(pieces: tuple[ShardPiece, ...], shards: list[torch.Tensor], num_kv_heads: int, producer_tp: int,
                layers: int, head_dim: int, dtype: torch.dtype, num_tokens: int) -> torch.Tensor:
    """The consumer rank's KV [layers, 2, num_tokens, its kv heads, head_dim] from the fetched
    `shards` (one per piece, each [layers, 2, num_tokens, shard's kv heads, head_dim]). Raises
    MalformedKV, naming the shard, for a shard that is not what its producer rank holds."""
    parts = []
    for piece, kv in zip(pieces, shards, strict=True):
        rank = piece.shard or 0
        held = len(kv_head_range(rank, producer_tp, num_kv_heads))
        try:
            check_kv_layout(kv, layers, (held, head_dim), dtype, num_tokens)
        except MalformedKV as e:
            where = "the transfer" if piece.shard is None else f"shard {rank} of {producer_tp}"
            raise MalformedKV(e.reason, f"{where} (prefill tensor_parallel_size={producer_tp}, "
                                        f"{num_kv_heads} kv heads): {e.message}") from None
        parts.append(kv if (piece.start, piece.stop) == (0, held) else kv[:, :, :, piece.start:piece.stop])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=3)
