"""Rotary position embedding tables (default, linear, Llama-3 scaled frequencies, and GGUF's
per-frequency factors)."""

from __future__ import annotations

import math

import torch

# A divisor per inverse frequency, as a GGUF file's rope_freqs tensor gives them (Llama 3.x).
FREQ_FACTORS = "freq_factors"


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == FREQ_FACTORS:
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    return _llama3_scaled(inv_freq, scaling)


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths are divided by `factor`, short ones
    are kept, and the band between is interpolated smoothly."""
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > old_len / low
    short_wave = wavelen < old_len / high
    smooth = (old_len / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(long_wave, inv_freq / factor, inv_freq)
    return torch.where(~long_wave & ~short_wave, interpolated, scaled)


def cos_sin_cache(head_dim: int, max_pos: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[max_pos, head_dim] = cat(cos, sin) of position * inverse frequency, in fp32."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
