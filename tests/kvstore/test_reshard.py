"""Re-sharding a prompt's KV by head between prefill and decode of different tensor-parallel
sizes (kvstore.reshard, and the connector's worker and scheduler sides around it).

Oracle: one whole KV tensor [layers, 2, tokens, kv_heads, head_dim] made by torch, sliced by
head as each rank's cache holds it; the paged caches' own bytes after a load."""

from __future__ import annotations

import pytest
import torch

from engine.errors import ParameterError
from engine.kv_connector import KVConnectorRole
from engine.kv_transfer_params import KVTransferParams
from engine.sched.output import KVConnectorOutput
from kvstore.connector import LoadSpec, PDConnector, PDConnectorMetadata
from kvstore.kv_io import MalformedKV, gather_kv, refusal_key, scatter_kv
from kvstore.reshard import check_pd_sizes, join_pieces, plan_pieces, readers
from kvstore.shards import shard_transfer_id
from kvstore.transports import LocalTransport
from kvstore.transports.sharded import ShardTransport

LAYERS, D, TOKENS = 3, 4, 21

# The KV heads each rank holds, written out: an even split, or (fewer heads than ranks) each
# head on size / heads consecutive ranks, the ranks whose query heads read it.
HELD = {
    (4, 1): [[0, 1, 2, 3]],
    (4, 2): [[0, 1], [2, 3]],
    (4, 4): [[0], [1], [2], [3]],
    (2, 4): [[0], [0], [1], [1]],
    (1, 2): [[0], [0]],
    (2, 8): [[0], [0], [0], [0], [1], [1], [1], [1]],
}
# (kv heads, prefill size, decode size): the small preset's 4 KV heads over 2 -> 1 and 1 -> 2,
# GQA with replicated heads on one side or both, and sizes no rank boundary shares.
CASES = [(4, 2, 1), (4, 1, 2), (4, 2, 4), (4, 4, 2), (2, 4, 1), (2, 1, 4), (2, 4, 8), (1, 2, 1), (6, 2, 3),
         (6, 3, 2), (4, 2, 2)]


def _held(heads: int, size: int) -> list[list[int]]:
    if (heads, size) in HELD:
        return HELD[(heads, size)]
    assert heads % size == 0
    return [list(range(r * heads // size, (r + 1) * heads // size)) for r in range(size)]


def _kv(heads: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(LAYERS, 2, TOKENS, heads, D, generator=torch.Generator().manual_seed(seed))


def _shards(kv: torch.Tensor, size: int) -> list[torch.Tensor]:
    """What each prefill rank exports: its own heads of the whole KV."""
    return [kv[:, :, :, held].contiguous() for held in _held(kv.shape[3], size)]


@pytest.mark.parametrize("heads,size", sorted(HELD))
def test_the_ranks_hold_the_heads_tensor_parallel_layers_give_them(heads, size):
    from engine.models.parallel import kv_head_range

    assert [list(kv_head_range(r, size, heads)) for r in range(size)] == HELD[(heads, size)]


@pytest.mark.parametrize("heads,producer_tp,consumer_tp", CASES)
def test_each_decode_rank_joins_exactly_its_heads_from_the_prefill_shards(heads, producer_tp, consumer_tp):
    kv = _kv(heads)
    shards = _shards(kv, producer_tp)
    for rank, held in enumerate(_held(heads, consumer_tp)):
        pieces = plan_pieces(heads, producer_tp, rank, consumer_tp)
        fetched = [shards[p.shard or 0] for p in pieces]
        got = join_pieces(pieces, fetched, heads, producer_tp, LAYERS, D, kv.dtype, TOKENS)
        torch.testing.assert_close(got, kv[:, :, :, held], rtol=0, atol=0)


def test_equal_sizes_read_their_own_shard_whole_and_a_one_rank_prefill_is_not_sharded():
    for rank in range(2):
        (piece,) = plan_pieces(4, 2, rank, 2)
        assert (piece.shard, piece.start, piece.stop, piece.transfer_id("t")) == (rank, 0, 2, f"t#rank{rank}")
    (piece,) = plan_pieces(2, 4, 3, 4)  # replicated heads: rank 3 still reads shard 3
    assert piece.shard == 3
    (piece,) = plan_pieces(4, 1, 1, 2)
    assert (piece.shard, piece.start, piece.stop, piece.transfer_id("t")) == (None, 2, 4, "t")
    shard = _kv(2)
    assert join_pieces(plan_pieces(4, 2, 1, 2), [shard], 4, 2, LAYERS, D, shard.dtype, TOKENS) is shard


def test_readers_count_the_decode_ranks_that_fetch_each_shard():
    assert readers(4, 2, 2) == {0: 1, 1: 1}
    assert readers(4, 1, 2) == {None: 2}  # both halves come from the one whole transfer
    assert readers(4, 2, 4) == {0: 2, 1: 2}
    assert readers(2, 4, 1) == {0: 1, 2: 1}  # each head once, from the first rank holding it


@pytest.mark.parametrize("heads,producer_tp,consumer_tp", [(4, 2, 1), (4, 1, 2), (2, 4, 1), (2, 1, 4)])
def test_paged_caches_of_other_block_sizes_load_the_heads_each_rank_holds(heads, producer_tp, consumer_tp):
    """Prefill ranks paged in blocks of 16, decode ranks in blocks of 8, other block ids: each
    decode rank's cache holds its heads of the prompt's KV, token for token."""
    kv = _kv(heads, seed=1)
    exported = []
    for held in _held(heads, producer_tp):
        caches = [(torch.zeros(4, 16, len(held), D), torch.zeros(4, 16, len(held), D)) for _ in range(LAYERS)]
        scatter_kv(caches, ((3, 1),), 0, TOKENS, 16, kv[:, :, :, held].contiguous(), TOKENS)
        exported.append(gather_kv(caches, ((3, 1),), TOKENS, 16))
    for rank, held in enumerate(_held(heads, consumer_tp)):
        caches = [(torch.zeros(8, 8, len(held), D), torch.zeros(8, 8, len(held), D)) for _ in range(LAYERS)]
        pieces = plan_pieces(heads, producer_tp, rank, consumer_tp)
        joined = join_pieces(pieces, [exported[p.shard or 0] for p in pieces], heads, producer_tp, LAYERS, D,
                             torch.float32, TOKENS)
        scatter_kv(caches, ((6, 0, 5),), 0, TOKENS, 8, joined, TOKENS)
        slots = [6 * 8 + t for t in range(8)] + [t for t in range(8)] + [5 * 8 + t for t in range(TOKENS - 16)]
        for layer, (k, v) in enumerate(caches):
            torch.testing.assert_close(k.view(-1, len(held), D)[slots], kv[layer, 0][:, held], rtol=0, atol=0)
            torch.testing.assert_close(v.view(-1, len(held), D)[slots], kv[layer, 1][:, held], rtol=0, atol=0)


def test_a_shard_with_other_heads_is_refused_naming_the_shard():
    kv = _kv(4)
    shards = _shards(kv, 2)
    shards[1] = shards[1][:, :, :, :1]  # a prefill rank of another split: 1 head, not 2
    pieces = plan_pieces(4, 2, 0, 1)
    with pytest.raises(MalformedKV, match=r"shard 1 of 2 \(prefill tensor_parallel_size=2, 4 kv heads\)") as e:
        join_pieces(pieces, shards, 4, 2, LAYERS, D, kv.dtype, TOKENS)
    assert e.value.reason == "shape"
    with pytest.raises(MalformedKV, match="tensor_parallel_size=3 does not split 4 kv heads") as e:
        plan_pieces(4, 3, 0, 1)
    assert e.value.reason == "shape"


@pytest.mark.parametrize("heads,kv_heads,sizes,field,needle", [
    (9, 3, (2, 1), "prefill_tensor_parallel_size", "prefill_tensor_parallel_size=2 does not divide "
                                                   "num_attention_heads=9"),
    (12, 4, (2, 6), "decode_tensor_parallel_size", "decode_tensor_parallel_size=6 neither divides "
                                                   "num_key_value_heads=4"),
])
def test_sizes_that_do_not_shard_the_heads_are_refused_naming_both_sizes(heads, kv_heads, sizes, field, needle):
    named = {"prefill_tensor_parallel_size": sizes[0], "decode_tensor_parallel_size": sizes[1]}
    with pytest.raises(ParameterError, match=needle) as e:
        check_pd_sizes(heads, kv_heads, named)
    assert e.value.field == field
    assert f"prefill_tensor_parallel_size={sizes[0]} and decode_tensor_parallel_size={sizes[1]}" in str(e.value)
    check_pd_sizes(8, 4, {"prefill_tensor_parallel_size": 2, "decode_tensor_parallel_size": 8})


def _consumer_rank(transport, rank: int, size: int, heads: int):
    worker = PDConnector(KVConnectorRole.WORKER, "consumer", ShardTransport(transport, rank) if size > 1 else
                         transport, "d0", 8, tensor_parallel_size=size, rank=rank, num_kv_heads=heads)
    held = _held(heads, size)[rank]
    caches = [(torch.zeros(4, 8, len(held), D), torch.zeros(4, 8, len(held), D)) for _ in range(LAYERS)]
    worker.register_kv_caches(caches)
    return worker, caches


def _load(worker, params: KVTransferParams) -> KVConnectorOutput:
    worker.start_load_kv(PDConnectorMetadata(loads=[LoadSpec("r", params, ((0, 1, 2),), 0, TOKENS)]))
    worker.start_load_kv(PDConnectorMetadata())  # the next step writes (or refuses) it
    return worker.get_finished()


def test_tensor_parallel_decode_ranks_share_a_one_rank_transfer_and_its_scheduler_side_releases_it():
    """Both decode ranks read the one transfer of a one-rank prefill: neither releases it (the
    other may still be fetching); the scheduler side does once both reported, exactly once."""
    transport = LocalTransport()
    kv = _kv(4, seed=2)
    transport.publish("t", kv, TOKENS)
    params = KVTransferParams(transfer_id="t", num_tokens=TOKENS, block_size=16, tensor_parallel_size=1)
    for rank in range(2):
        worker, caches = _consumer_rank(transport, rank, 2, 4)
        assert _load(worker, params).finished_recving == {"r"}
        got = torch.stack([torch.stack([k.view(-1, 2, D)[:TOKENS], v.view(-1, 2, D)[:TOKENS]]) for k, v in caches])
        torch.testing.assert_close(got, kv[:, :, :, 2 * rank:2 * rank + 2], rtol=0, atol=0)
        assert transport.live_transfers == 1
    scheduler = PDConnector(KVConnectorRole.SCHEDULER, "consumer", transport, "d0", 8, tensor_parallel_size=2,
                            num_kv_heads=4)
    scheduler._loading["r"] = params  # as update_state_after_alloc leaves a load it handed out
    scheduler.update_connector_output(KVConnectorOutput(finished_recving={"r"}))
    assert transport.live_transfers == 0


def test_a_one_rank_decode_joins_both_prefill_shards_and_releases_the_transfer():
    transport = LocalTransport()
    kv = _kv(4, seed=3)
    for rank, shard in enumerate(_shards(kv, 2)):
        ShardTransport(transport, rank).publish("t", shard, TOKENS)
    worker, caches = _consumer_rank(transport, 0, 1, 4)
    assert worker.num_kv_heads == 4  # read from its cache
    params = KVTransferParams(transfer_id="t", num_tokens=TOKENS, block_size=16, tensor_parallel_size=2)
    assert _load(worker, params).finished_recving == {"r"}
    got = torch.stack([torch.stack([k.view(-1, 4, D)[:TOKENS], v.view(-1, 4, D)[:TOKENS]]) for k, v in caches])
    torch.testing.assert_close(got, kv, rtol=0, atol=0)
    assert transport.live_transfers == 0  # released by its whole name, with its shards


def test_a_mismatching_shard_is_refused_counted_and_nothing_is_written():
    transport = LocalTransport()
    kv = _kv(4, seed=4)
    shards = _shards(kv, 2)
    transport.publish(shard_transfer_id("t", 0), shards[0], TOKENS)
    transport.publish(shard_transfer_id("t", 1), torch.cat([shards[1], shards[1]], dim=3), TOKENS)  # 4 heads
    worker, caches = _consumer_rank(transport, 0, 1, 4)
    params = KVTransferParams(transfer_id="t", num_tokens=TOKENS, block_size=16, tensor_parallel_size=2)
    failed = _load(worker, params).failed_recving
    assert "malformed KV (shape): shard 1 of 2" in failed["r"]
    assert worker.transfer_stats()[refusal_key("shape")] == 1
    assert all(not k.any() and not v.any() for k, v in caches)
