"""A rank's view of a transport: it exports its own shard; as a consumer it fetches and releases
what the connector names (the producer shards its heads come from, kvstore.reshard)."""

from __future__ import annotations

from engine.kv_transfer_params import KVTransferParams
from kvstore.transports import LocalTransport
from kvstore.transports.sharded import ShardTransport


def test_rank_publishes_its_own_shard_and_fetches_what_it_is_told():
    inner = LocalTransport()
    ShardTransport(inner, 1).publish("t", "kv-of-rank-1", 4)
    got = []
    ShardTransport(inner, 0).fetch_async(KVTransferParams(transfer_id="t#rank1", num_tokens=4), got.append)
    assert got == ["kv-of-rank-1"]


def test_releasing_a_whole_transfer_releases_its_shards():
    inner = LocalTransport()
    for rank in range(2):
        ShardTransport(inner, rank).publish("t", f"kv-of-rank-{rank}", 4)
    inner.publish("u", "another", 4)
    ShardTransport(inner, 0).release(KVTransferParams(transfer_id="t", num_tokens=4, tensor_parallel_size=2))
    assert inner.live_transfers == 1
