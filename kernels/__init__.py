"""Kernels behind the contract of ARCHITECTURE.md §3.

`get_ops(backend)` returns the implementation the engine calls; the torch references in
`kernels.reference` are the specification and the CPU implementation.
"""

from __future__ import annotations

from types import SimpleNamespace

from kernels import reference


def get_ops(backend: str = "torch") -> SimpleNamespace:
    if backend != "torch":
        raise ValueError(f"kernel backend must be 'torch', got {backend!r}")
    return SimpleNamespace(
        reshape_and_cache=reference.reshape_and_cache,
        paged_attention=reference.paged_attention,
        rms_norm=reference.rms_norm,
        rotary_embedding=reference.rotary_embedding,
        silu_and_mul=reference.silu_and_mul,
    )
