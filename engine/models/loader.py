"""Load a checkpoint (Hugging Face safetensors directory or GGUF file) into our CausalLM.

The model is built on the meta device and materialised once on the target device; each
checkpoint tensor is read (from safetensors, or dequantized from GGUF) and copied straight
into its (possibly fused) destination slice, so no full second copy of the weights ever exists.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import torch
from safetensors import safe_open

from engine.models.arch import ModelArch
from engine.models.gguf_file import find_gguf
from engine.models.gguf_weights import gguf_tensors
from engine.models.llama import CausalLM
from engine.models.rotary import cos_sin_cache

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def resolve_dtype(dtype: str, arch: ModelArch, device: torch.device) -> torch.dtype:
    """auto: fp32 on CPU (our CPU path and its parity tests are fp32); on GPU the
    checkpoint's dtype if it is 16-bit, else bf16."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    if arch.torch_dtype in ("bfloat16", "float16"):
        return _DTYPES[arch.torch_dtype]
    return torch.bfloat16


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise ValueError(f"model: no model.safetensors or model.safetensors.index.json in {model_dir!r}")


def load_model(
    model_dir: str,
    arch: ModelArch,
    ops: SimpleNamespace,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(arch, ops, max_positions).to(dtype)
    model = model.to_empty(device=device)
    # The rope table is derived, not loaded: rebuild it in fp32 (to_empty left it empty).
    model.cos_sin = cos_sin_cache(
        arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling_dict
    ).to(device)

    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, read in _checkpoint_tensors(model_dir, arch):
        target = _destination(name, arch, params)
        if target is None:
            continue
        param_name, rows = target
        dst = params[param_name].data
        if rows is not None:
            dst = dst[rows[0] : rows[1]]
        tensor = read()
        if tensor.shape != dst.shape:
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dst.shape)}"
            )
        dst.copy_(tensor)
        loaded.add(f"{param_name}:{rows}")
    expected = _expected_pieces(arch, params)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint in {model_dir!r} is missing weights: {missing[:8]}")
    return model.eval()


def _checkpoint_tensors(model: str, arch: ModelArch) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(HF tensor name, read) pairs; reading is deferred so skipped tensors cost nothing."""
    gguf = find_gguf(model)
    if gguf is not None:
        yield from gguf_tensors(gguf, arch)
        return
    for path in checkpoint_files(model):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, lambda f=f, name=name: f.get_tensor(name)


def _destination(name: str, arch: ModelArch, params: dict) -> tuple[str, tuple[int, int] | None] | None:
    """Map a HF tensor name to (our parameter, row range inside a fused parameter)."""
    if name == "lm_head.weight":
        return None if arch.tie_word_embeddings else ("lm_head.weight", None)
    if name in ("model.embed_tokens.weight", "model.norm.weight"):
        return name.removeprefix("model."), None
    m = _LAYER.match(name)
    if m is None:
        return None
    layer, rest = m.group(1), m.group(2)
    prefix = f"layers.{layer}."
    h, hkv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    inter = arch.intermediate_size
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, h * d),
        "self_attn.k_proj": ("self_attn.qkv_proj", h * d, (h + hkv) * d),
        "self_attn.v_proj": ("self_attn.qkv_proj", (h + hkv) * d, (h + 2 * hkv) * d),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
        "mlp.up_proj": ("mlp.gate_up_proj", inter, 2 * inter),
    }
    module, _, kind = rest.rpartition(".")
    if module in fused:
        ours, start, end = fused[module]
        return f"{prefix}{ours}.{kind}", (start, end)
    full = prefix + rest
    return (full, None) if full in params else None


def _expected_pieces(arch: ModelArch, params: dict) -> set[str]:
    pieces = set()
    h, hkv, d, inter = arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.intermediate_size
    for name in params:
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            for rows in ((0, h * d), (h * d, (h + hkv) * d), ((h + hkv) * d, (h + 2 * hkv) * d)):
                pieces.add(f"{name}:{rows}")
        elif "gate_up_proj" in name:
            for rows in ((0, inter), (inter, 2 * inter)):
                pieces.add(f"{name}:{rows}")
        else:
            pieces.add(f"{name}:None")
    return pieces
