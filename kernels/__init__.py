"""Kernels behind the contract of docs/architecture.md#kernels.

`get_ops(backend)` returns the implementation the engine calls: "torch" (the references in
`kernels.reference`, which are the specification, and on CPU the C kernels of `kernels.cpu`
with the same contract) or "triton" (the kernels in
`kernels.triton_kernels`, for CUDA; on CPU only under TRITON_INTERPRET=1, as the tests run them).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from kernels import reference

BACKENDS = ("torch", "triton")
_OPS = ("reshape_and_cache", "paged_attention", "rms_norm", "rotary_embedding", "silu_and_mul",
        "gelu_tanh_and_mul", "fused_moe", "lora_shrink", "lora_expand", "lora_apply")


def default_backend(device_type: str) -> str:
    return "triton" if device_type == "cuda" else "torch"


def get_ops(backend: str = "torch", device_type: str = "cpu") -> SimpleNamespace:
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        ops = SimpleNamespace(**{name: getattr(reference, name) for name in _OPS})
        if device_type == "cpu":
            from kernels import cpu
            from kernels.cpu.build import library

            library()  # built now, while the engine starts, not inside its first step
            for name in ("paged_attention", "rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "rotary_embedding",
                         "reshape_and_cache"):
                setattr(ops, name, getattr(cpu, name))
            from kernels.cpu import lora as cpu_lora

            for name in ("lora_shrink", "lora_expand", "lora_apply"):
                setattr(ops, name, getattr(cpu_lora, name))
        return ops
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "kernel_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 set before "
            "triton is imported, for testing on CPU)"
        )
    from kernels import triton_kernels

    return SimpleNamespace(**{name: getattr(triton_kernels, name) for name in _OPS})


def apply_token_bitmask(logits, bitmask, rows) -> None:
    """Structured outputs' mask (contract in kernels.reference.apply_token_bitmask): the Triton
    kernel on CUDA, the torch reference elsewhere."""
    if logits.is_cuda:
        from kernels import triton_kernels

        triton_kernels.apply_token_bitmask(logits, bitmask, rows)
    else:
        reference.apply_token_bitmask(logits, bitmask, rows)
