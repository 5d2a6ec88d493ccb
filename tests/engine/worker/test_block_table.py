"""BlockTable slot mapping (docs/architecture.md#kernels) and the persistent input batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.worker.block_table import BlockTable
from engine.worker.buffers import StagedBuffer
from engine.worker.input_batch import InputBatch

CPU = torch.device("cpu")


def test_slot_mapping_follows_the_formula():
    bt = BlockTable(max_num_reqs=2, max_num_blocks_per_req=4, block_size=4, kernel_block_size=4, device=CPU)
    bt.add_row(0, [7, 2, 9])
    bt.add_row(1, [5])
    rows = np.array([0, 0, 0, 0, 1, 1])
    pos = np.array([0, 3, 4, 9, 0, 2])
    slots = bt.compute_slot_mapping(rows, pos)
    expected = [7 * 4 + 0, 7 * 4 + 3, 2 * 4 + 0, 9 * 4 + 1, 5 * 4 + 0, 5 * 4 + 2]
    assert slots.tolist() == expected


def test_kernel_blocks_split_each_allocation_block():
    bt = BlockTable(1, 3, block_size=8, kernel_block_size=4, device=CPU)
    bt.add_row(0, [3, 0])
    assert bt.table.np[0, :4].tolist() == [6, 7, 0, 1]
    # Same memory either way: slot = alloc_block * 8 + pos % 8.
    pos = np.arange(16)
    slots = bt.compute_slot_mapping(np.zeros(16, dtype=np.int64), pos)
    assert slots.tolist() == [3 * 8 + p for p in range(8)] + [0 * 8 + p for p in range(8)]


def test_append_row_extends_and_overflow_is_an_error():
    bt = BlockTable(1, 2, block_size=4, kernel_block_size=4, device=CPU)
    bt.add_row(0, [1])
    bt.append_row(0, [4])
    assert bt.table.np[0, :2].tolist() == [1, 4]
    with pytest.raises(ValueError, match="kernel blocks"):
        bt.append_row(0, [5])


def test_staged_buffer_on_cpu_is_one_tensor():
    buf = StagedBuffer(8, torch.int64, CPU)
    buf.np[:3] = [1, 2, 3]
    out = buf.to_device(3)
    assert out.data_ptr() == buf.cpu.data_ptr() and out.tolist() == [1, 2, 3]


def _batch():
    return InputBatch(max_num_reqs=4, max_model_len=32, block_size=4, kernel_block_size=4, device=CPU)


def test_input_batch_keeps_rows_dense_after_removal():
    ib = _batch()
    p = SamplingParams()
    for i, rid in enumerate(["a", "b", "c"]):
        ib.add_request(rid, [i + 1] * (i + 2), i + 2, 0, [i], p, CPU)
    ib.remove_request("a")
    assert ib.req_ids == ["c", "b"]
    row = ib.req_id_to_row["c"]
    assert row == 0 and ib.num_tokens[row] == 4 and ib.token_ids[row, :4].tolist() == [3] * 4
    assert ib.block_table.table.np[row, 0] == 2


def test_seeded_request_generator_survives_preemption_only():
    ib = _batch()
    p = SamplingParams(seed=7, temperature=1.0)
    ib.add_request("a", [1, 2], 2, 0, [0], p, CPU)
    gen = ib.generators["a"]
    ib.remove_request("a", keep_generator=True)
    ib.add_request("a", [1, 2, 3], 2, 0, [0], p, CPU)
    assert ib.generators["a"] is gen
    ib.remove_request("a")
    assert "a" not in ib.generators
