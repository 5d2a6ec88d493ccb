"""A GGUF file's tensors under their Hugging Face names, dequantized, in HF's rotary layout.

The loader consumes (name, read) pairs from either format, so the fused-parameter mapping,
shape checks and missing-weight check are shared with safetensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import numpy as np
import torch

from engine.errors import ParameterError
from engine.models.arch import ModelArch
from engine.models.gguf_file import PERMUTED_QK, ROPE_TENSORS, gguf_architecture, open_gguf
from engine.models.gguf_quants import check_type, dequantize

_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Where an architecture's names differ. Phi-3 keeps HF's fused tensors: attn_qkv holds the
# [q; k; v] rows and ffn_up the [gate; up] rows (the loader splits both). Gemma's sandwich
# norms: llama.cpp's ffn_norm is the norm before the MLP, post_attention_norm the one after
# attention, which HF calls post_attention_layernorm.
_GEMMA_LAYER = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_LAYER = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": _GEMMA_LAYER,
    "gemma3": _GEMMA_LAYER,
}
_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (`arch`: the file's
    general.architecture); an unknown tensor is an error naming it (a file we would silently
    half-load is worse than a refusal)."""
    per_layer = {**_PER_LAYER, **_ARCH_LAYER.get(arch, {})}
    m = _LAYER.match(gguf_name)
    if m is not None and m.group(2) in per_layer:
        return f"model.layers.{m.group(1)}.{per_layer[m.group(2)]}.{m.group(3)}"
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{kind}"
    raise ParameterError("model", f"GGUF tensor {gguf_name!r} is not part of the {arch!r} architecture "
                         f"{sorted(per_layer) + sorted(_GLOBAL)}")


def unpermute_rotary(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation. Per head, llama.cpp orders rows as the pairs
    (r0, r_{D/2}), (r1, r_{D/2+1}), ... that its interleaved rotary turns together; HF's
    half-split rotary wants the first halves, then the second halves. w: [H*D, ...]."""
    rest = w.shape[1:]
    pairs = w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *rest)  # [H, D/2, 2, ...]
    return pairs.transpose(1, 2).reshape(w.shape)


def gguf_tensors(path: str, arch: ModelArch) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(HF name, read) for every tensor; `read()` returns it dense (fp32, or the stored float
    type). Unsupported quantization types are refused before any tensor is read. Gemma's
    norms arrive as stored: llama.cpp's converter has already added HF's 1 to them."""
    reader = open_gguf(path)
    for t in reader.tensors:
        check_type(t.tensor_type.name, t.name)
    file_arch = gguf_architecture(path)
    permuted = file_arch in PERMUTED_QK
    for t in reader.tensors:
        if t.name in ROPE_TENSORS:
            continue  # not a weight: the rotary table's factors (engine.models.gguf_file)
        name = hf_name(t.name, file_arch)
        heads = {".q_proj.": arch.num_heads, ".k_proj.": arch.num_kv_heads}
        rotary_heads = next((h for key, h in heads.items() if key in name), None) if permuted else None
        yield name, _reader(t, rotary_heads)


def _reader(t, rotary_heads: int | None) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists the innermost dim first
        raw = torch.from_numpy(np.asarray(t.data).reshape(-1).view(np.uint8))
        w = dequantize(raw, t.tensor_type.name, shape)
        return w if rotary_heads is None else unpermute_rotary(w, rotary_heads)

    return read
