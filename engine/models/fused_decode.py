"""CausalLM's short-query steps (decode, speculative verification) as one C call on CPU
(kernels.cpu.decode_stack) when the model is a plain Llama-shaped stack over GGUF blocks.

Why: a batch-1 decode step of a 30-layer model is ~300 kernel calls of a few microseconds of
work each; from Python each also pays its argument checks, a tensor allocation and ctypes
(docs/kernels.md#one-call-decode). The stack makes the same calls from C, so its hidden
states are bit for bit those of the layer-by-layer path (tests/engine/test_fused_decode.py).

Which models: one rank, no LoRA, every projection kept in GGUF blocks with a C kernel, no
biases, no q/k norms or sandwich norms, SiLU MLP, full attention (no windows, no soft-cap),
the C kernels as the model's ops. Which steps: fp32 on CPU, every query run at most
MAX_QUERY_LEN tokens. Anything else runs the layers as before. PDSERVE_FUSED_DECODE=0 turns
it off (benchmarks compare the two).
"""

from __future__ import annotations

import logging
import os

import torch

from engine.models.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)
ENV = "PDSERVE_FUSED_DECODE"


def _segments(linear) -> list | None:
    q = getattr(linear, "quant", None)
    if q is None or getattr(linear, "lora", None) is not None or getattr(linear, "bias", None) is not None:
        return None
    from kernels.cpu import quant

    if not all(quant.supported(s.qtype, q.in_features) and getattr(s, "perm", None) is None for s in q.segments):
        return None
    return [(s.start, s.qtype, s.data) for s in q.segments]


def why_not(model) -> str | None:
    """Why `model` (a CausalLM) cannot run its steps as one stack; None when it can."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    from kernels import cpu
    from kernels.cpu.build import library

    arch = model.arch
    if library() is None:
        return "no native CPU kernels"
    if model.tp.size != 1:
        return "tensor parallel"
    if (arch.qk_norm or arch.sandwich_norms or arch.qkv_bias or arch.o_bias or arch.mlp_bias
            or arch.hidden_act != "silu" or arch.num_experts or arch.has_windows or arch.attn_softcap
            or arch.local_rope_theta is not None):
        return "not a plain Llama layer"
    for layer in model.layers:
        a = layer.self_attn
        ops = a.ops
        if any(getattr(ops, name) is not getattr(cpu, name)
               for name in ("paged_attention", "rms_norm", "silu_and_mul", "rotary_embedding", "reshape_and_cache")):
            return "not the C kernels"
        if any(_segments(p) is None for p in (a.qkv_proj, a.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)):
            return "a projection not kept in GGUF blocks with a C kernel (or with LoRA or a bias)"
    return None


def build(model):
    """A kernels.cpu.decode_stack.DecodeStack over `model`'s weights, or None (logged why)."""
    reason = why_not(model)
    if reason is not None:
        logger.debug("layer-by-layer steps: %s", reason)
        return None
    from kernels.cpu.decode_stack import DecodeStack, StackDims, StackLayer

    arch, first = model.arch, model.layers[0]
    dims = StackDims(arch.hidden_size, first.self_attn.h, first.self_attn.hkv, first.self_attn.d,
                     model.layout.intermediate_size, arch.rms_norm_eps, first.self_attn.scale)
    layers = [StackLayer(L.input_layernorm.weight.data, L.post_attention_layernorm.weight.data,
                         _segments(L.self_attn.qkv_proj), _segments(L.self_attn.o_proj),
                         _segments(L.mlp.gate_up_proj), _segments(L.mlp.down_proj)) for L in model.layers]
    try:
        return DecodeStack(dims, layers, model.cos_sin, model.norm.weight.data)
    except ValueError as e:  # a shape the C stack does not take: the layers run as before
        logger.debug("layer-by-layer steps: %s", e)
        return None


def accepts(x: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether this step's tokens can take the stack (short query runs, fp32 on CPU)."""
    from kernels.cpu.decode_stack import MAX_QUERY_LEN

    return (meta.max_query_len <= MAX_QUERY_LEN and meta.window_group is None and x.dtype == torch.float32
            and x.device.type == "cpu")
