"""Arithmetic of the GPU benchmarks (the scripts themselves need a GPU)."""

from __future__ import annotations

import pytest

from scripts.gpu_roofline import (
    decode_attention_bytes,
    decode_step_bytes,
    model_bandwidth_utilization,
    peak_bandwidth_gbps,
)


def test_peak_bandwidth_lookup_and_override():
    assert peak_bandwidth_gbps("NVIDIA H200") == 4800.0
    assert peak_bandwidth_gbps("NVIDIA H100 80GB HBM3", 1234.0) == 1234.0
    assert peak_bandwidth_gbps("Some GPU") is None


def test_decode_attention_bytes_counts_kv_once_plus_q_and_out():
    # batch 2, ctx 10, 4 q heads, 2 kv heads, dim 8, bf16
    assert decode_attention_bytes(2, 10, 4, 2, 8, 2) == 2 * 2 * 10 * 2 * 8 * 2 + 2 * 2 * 4 * 8 * 2


def test_decode_step_bytes_and_mbu():
    step = decode_step_bytes(1_000_000, [100, 300], num_layers=2, num_kv_heads=2, head_dim=4, itemsize=2)
    assert step == 1_000_000 + 2 * 2 * 2 * 4 * 2 * 400
    assert model_bandwidth_utilization(step, 1e-3, 2.0) == pytest.approx(step / 1e-3 / 2e9)
