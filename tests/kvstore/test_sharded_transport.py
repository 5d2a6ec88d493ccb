"""A rank's view of a transport: its shard of a sharded transfer, the whole of an unsharded one."""

from __future__ import annotations

from engine.kv_transfer_params import KVTransferParams
from kvstore.transports import LocalTransport
from kvstore.transports.sharded import ShardTransport


def test_rank_publishes_fetches_and_releases_its_own_shard():
    inner = LocalTransport()
    rank1 = ShardTransport(inner, 1)
    rank1.publish("t", "kv-of-rank-1", 4)
    got = []
    rank1.fetch_async(KVTransferParams(transfer_id="t", num_tokens=4, tensor_parallel_size=2), got.append)
    assert got == ["kv-of-rank-1"]
    rank1.release(KVTransferParams(transfer_id="t", num_tokens=4, tensor_parallel_size=2))
    assert inner.live_transfers == 0


def test_a_transfer_from_a_one_rank_prefill_is_released_by_its_own_name():
    inner = LocalTransport()
    inner.publish("t", "whole", 4)
    ShardTransport(inner, 0).release(KVTransferParams(transfer_id="t", num_tokens=4))
    assert inner.live_transfers == 0
