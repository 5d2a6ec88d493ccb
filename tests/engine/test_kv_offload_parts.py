"""The host tier's parts on their own: the worker side's pool (checksums, byte bound), the
scheduler side's index (LRU, events in order) and the MultiConnector's rules (first match
wins, holders counted, events and holdings merged), against a stand-in connector."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache.events import HOST, BlockRemoved, BlockStored
from engine.kv_connector import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from engine.kv_offload.host_index import HostIndex
from engine.kv_offload.host_pool import HostPool, PagedBlocks, RefusedBlock
from engine.kv_offload.multi import MultiConnector
from engine.sched.output import KVConnectorOutput

SHAPE = (2, 2, 4, 1, 3)  # [layers, 2, block_size, Hkv, D]


def _block(fill: float) -> torch.Tensor:
    return torch.full(SHAPE, float(fill))


def _nbytes() -> int:
    return _block(0).numel() * 4


def test_pool_returns_what_was_stored():
    pool = HostPool(10 * _nbytes())
    pool.put(b"a", _block(1.5))
    assert torch.equal(pool.get(b"a", SHAPE, torch.float32), _block(1.5))


def test_pool_refuses_changed_bytes_other_shapes_dtypes_and_missing_blocks():
    pool = HostPool(10 * _nbytes())
    pool.put(b"a", _block(1.0))
    with pytest.raises(RefusedBlock, match="shape"):
        pool.get(b"a", (2, 2, 8, 1, 3), torch.float32)
    with pytest.raises(RefusedBlock, match="dtype"):
        pool.get(b"a", SHAPE, torch.bfloat16)
    with pytest.raises(RefusedBlock, match="not in"):
        pool.get(b"b", SHAPE, torch.float32)
    pool._blocks[b"a"].data[0, 0, 0, 0, 0] = 2.0
    with pytest.raises(RefusedBlock, match="crc32"):
        pool.get(b"a", SHAPE, torch.float32)


def test_pool_keeps_within_its_bytes_dropping_the_least_recently_used():
    pool = HostPool(3 * _nbytes())
    for name in (b"a", b"b", b"c"):
        pool.put(name, _block(0))
    pool.get(b"a", SHAPE, torch.float32)  # now the newest
    pool.put(b"d", _block(0))
    assert b"b" not in pool and {b"a", b"c", b"d"} <= set(pool._blocks)
    assert pool.bytes_held == 3 * _nbytes() and pool.self_evictions == 1
    pool.drop(b"a")
    assert pool.bytes_held == 2 * _nbytes()


def test_paged_blocks_copy_a_whole_block_out_and_back_at_any_kernel_page_size():
    # Two layers of 3 allocation blocks of 4 tokens, paged by the kernels in 2-token pages.
    caches = [(torch.randn(6, 2, 1, 3), torch.randn(6, 2, 1, 3)) for _ in range(2)]
    paged = PagedBlocks(caches, block_size=4)
    out = paged.copy_out(1)
    assert tuple(out.shape) == SHAPE
    assert torch.equal(out[1, 1], caches[1][1][2:4].reshape(4, 1, 3))
    paged.copy_in(2, out)
    assert torch.equal(caches[0][0][4:6], caches[0][0][2:4])


def test_index_evicts_least_recently_used_and_tells_events_in_order():
    index = HostIndex(capacity_blocks=2, block_size=4)
    assert index.add(b"a", None) == [] and index.add(b"b", b"a") == []
    index.touch([b"a"])
    assert index.add(b"c", b"b") == [b"b"]
    assert index.hashes() == (b"a", b"c")
    events = index.take_events()
    # The run a, b is told before b's eviction; c starts a run under its parent.
    assert events == [BlockStored((b"a", b"b"), None, 8, HOST), BlockRemoved((b"b",), HOST),
                      BlockStored((b"c",), b"b", 4, HOST)]
    assert index.prefix_hits([b"a", b"c", b"x"], 0, 3) == 2
    assert index.remove([b"a", b"x"]) == [b"a"]
    assert index.take_events() == [BlockRemoved((b"a",), HOST)]


class StandIn(KVConnectorBase):
    """A connector that matches `matched` tokens, holds finished requests when `holds`,
    reports what it is told to, and has one 'shared' block."""

    def __init__(self, role, matched=0, holds=False, policy="fail", name="x") -> None:
        super().__init__(role)
        self.matched, self.holds, self.kv_load_failure_policy, self.name = matched, holds, policy, name
        self.allocs, self.metas, self.finished = [], [], KVConnectorOutput()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.matched, self.matched > 0

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocs.append(num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def update_connector_output(self, output):
        pass

    def request_finished(self, request, block_ids):
        return self.holds, None

    def register_kv_caches(self, kv_caches, layer_groups=None):
        pass

    def set_wakeup(self, callback):
        pass

    def start_load_kv(self, metadata):
        self.metas.append(metadata)

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata):
        pass

    def wait_for_save(self, metadata):
        pass

    def get_finished(self):
        out, self.finished = self.finished, KVConnectorOutput()
        return out

    def transfer_stats(self):
        return {f"{self.name}_loads": 1}

    def take_kv_events(self):
        return [BlockRemoved((self.name.encode(),), "shared")]

    def kv_held(self):
        return {"shared": (self.name.encode(),)}


class _Request:
    request_id = "r"


def test_the_first_connector_that_matches_wins_and_alone_loads():
    a, b = StandIn(KVConnectorRole.SCHEDULER, 0), StandIn(KVConnectorRole.SCHEDULER, 32, policy="recompute")
    c = StandIn(KVConnectorRole.SCHEDULER, 16)
    multi = MultiConnector(KVConnectorRole.SCHEDULER, [a, b, c])
    assert multi.get_num_new_matched_tokens(_Request(), 0) == (32, True)
    multi.update_state_after_alloc(_Request(), ([1, 2],), 32)
    assert (a.allocs, b.allocs, c.allocs) == ([0], [32], [0])
    assert multi.load_failure_policy("r") == "recompute"
    assert multi.load_failure_policy("other") == "fail"  # the first connector's


def test_a_request_held_by_two_connectors_is_freed_when_both_reported():
    sched = [StandIn(KVConnectorRole.SCHEDULER, holds=True), StandIn(KVConnectorRole.SCHEDULER, holds=True)]
    multi = MultiConnector(KVConnectorRole.SCHEDULER, sched)
    assert multi.request_finished(_Request(), ([],)) == (True, None)
    meta = multi.build_connector_meta(None)
    worker = [StandIn(KVConnectorRole.WORKER), StandIn(KVConnectorRole.WORKER)]
    wmulti = MultiConnector(KVConnectorRole.WORKER, worker)
    wmulti.start_load_kv(meta)
    assert [w.metas for w in worker] == [[meta.metas[0]], [meta.metas[1]]]
    worker[0].finished.finished_sending.add("r")
    assert wmulti.get_finished().finished_sending == set()
    worker[1].finished.finished_sending.add("r")
    assert wmulti.get_finished().finished_sending == {"r"}


def test_events_holdings_and_counters_of_both_connectors_are_merged():
    a = StandIn(KVConnectorRole.SCHEDULER, name="a")
    b = StandIn(KVConnectorRole.SCHEDULER, name="b")
    multi = MultiConnector(KVConnectorRole.SCHEDULER, [a, b])
    assert multi.take_kv_events() == [BlockRemoved((b"a",), "shared"), BlockRemoved((b"b",), "shared")]
    assert multi.kv_held() == {"shared": (b"a", b"b")}
    assert multi.transfer_stats() == {"a_loads": 1, "b_loads": 1}
