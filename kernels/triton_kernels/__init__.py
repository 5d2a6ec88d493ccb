"""Triton implementations of the kernel contract (docs/architecture.md#kernels).

Each function has the signature of its torch reference in `kernels.reference`. They run on
CUDA, and on CPU under TRITON_INTERPRET=1 (which is how the tests check them). Inputs are
upcast to fp32 inside the kernels before any arithmetic, so fp16/bf16 work in the interpreter.
"""

from kernels.triton_kernels.activation import gelu_tanh_and_mul, silu_and_mul
from kernels.triton_kernels.attention import paged_attention
from kernels.triton_kernels.bitmask import apply_token_bitmask
from kernels.triton_kernels.cache import reshape_and_cache
from kernels.triton_kernels.lora import lora_apply, lora_expand, lora_shrink
from kernels.triton_kernels.moe import fused_moe
from kernels.triton_kernels.norm import rms_norm
from kernels.triton_kernels.rotary import rotary_embedding

__all__ = ["apply_token_bitmask", "fused_moe", "gelu_tanh_and_mul", "lora_apply", "lora_expand", "lora_shrink", "paged_attention",
           "reshape_and_cache", "rms_norm", "rotary_embedding", "silu_and_mul"]
