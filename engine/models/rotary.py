"""Rotary position embedding tables (default, linear, Llama-3 scaled frequencies, GGUF's
per-frequency factors, and Phi-3's LongRoPE)."""

from __future__ import annotations

import math

import torch

# A divisor per inverse frequency, as a GGUF file's rope_freqs tensor gives them (Llama 3.x).
FREQ_FACTORS = "freq_factors"
LONGROPE = "longrope"


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim // 2] fp32; `head_dim` is the rotated width (the rotary dim). LongRoPE has
    two sets: use longrope_frequencies."""
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


def longrope_frequencies(rot_dim: int, theta: float, s: dict, long: bool) -> torch.Tensor:
    """LongRoPE's inverse frequencies, each divided by its short (or long) factor; written as
    transformers writes it, so the fp32 rounding is the same."""
    factors = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (factors * theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))


def cos_sin_cache(rot_dim: int, max_pos: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[max_pos, rot_dim] = cat(cos, sin) of position * inverse frequency, in fp32.

    LongRoPE (times its attention factor): the short factors when the engine's context
    (`max_pos`, its max_model_len) fits the original pretraining length, else the long ones
    for every position, as vLLM does. transformers picks the set by the sequence's current
    length and, once a sequence grows past the original length, recomputes its cache with the
    long set; a paged cache shared between requests cannot re-rotate its keys, so one set per
    engine keeps every key valid (prefix caching, chunked prefill). It matches transformers
    exactly for every sequence when max_model_len fits in the original length, and for every
    prompt longer than it otherwise.
    """
    positions = torch.arange(max_pos, dtype=torch.float32)
    if scaling and scaling["rope_type"] == LONGROPE:
        long = max_pos > scaling["original_max_position_embeddings"]
        freqs = torch.outer(positions, longrope_frequencies(rot_dim, theta, scaling, long))
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * scaling["attention_factor"]
    freqs = torch.outer(positions, inverse_frequencies(rot_dim, theta, scaling))
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
