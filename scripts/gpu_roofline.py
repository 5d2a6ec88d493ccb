"""Bandwidth arithmetic shared by the GPU benchmarks (pure functions, tested on CPU)."""

from __future__ import annotations

# Peak HBM bandwidth in GB/s by device name fragment (vendor data sheets).
PEAK_GBPS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100": 3350.0, "A100-SXM4-80GB": 2039.0,
             "A100": 1555.0, "L40S": 864.0, "L4": 300.0, "A10": 600.0}


def peak_bandwidth_gbps(device_name: str, override: float | None = None) -> float | None:
    if override:
        return override
    for key, value in PEAK_GBPS.items():
        if key in device_name:
            return value
    return None


def decode_attention_bytes(batch: int, context: int, num_heads: int, num_kv_heads: int,
                           head_dim: int, itemsize: int) -> int:
    """Bytes a decode attention step must move: every request's K and V once, plus q and out."""
    kv = 2 * batch * context * num_kv_heads * head_dim * itemsize
    q_out = 2 * batch * num_heads * head_dim * itemsize
    return kv + q_out


def decode_step_bytes(weight_bytes: int, context_lens: list[int], num_layers: int, num_kv_heads: int,
                      head_dim: int, itemsize: int) -> int:
    """Bytes one decode step reads: all weights once plus every request's KV in every layer."""
    kv_per_token = 2 * num_layers * num_kv_heads * head_dim * itemsize
    return weight_bytes + kv_per_token * sum(context_lens)


def model_bandwidth_utilization(bytes_per_step: int, step_seconds: float, peak_gbps: float) -> float:
    return bytes_per_step / step_seconds / (peak_gbps * 1e9)
