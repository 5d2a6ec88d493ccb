"""Load a checkpoint (Hugging Face safetensors directory or GGUF file) into our CausalLM.

The model is built on the meta device and materialised once on the target device; each
checkpoint tensor is read (from safetensors, or dequantized from GGUF) and copied straight
into its (possibly fused) destination slice, so no full second copy of the weights ever exists.
Under tensor parallelism each rank reads only its own slice of each safetensors tensor
(`get_slice`); a GGUF tensor is dequantized whole and then narrowed (its quantized blocks do
not split on shard boundaries in general). Under expert parallelism each rank reads only its
own experts, whole; the other ranks' expert tensors are never read.
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

from engine.distributed import SINGLE_EP, SINGLE_RANK, EPGroup, TPGroup
from engine.errors import ParameterError
from engine.models.arch import ModelArch
from engine.models.gguf_file import find_gguf
from engine.models.gguf_plan import QuantPlan
from engine.models.gguf_weights import gguf_tensors
from engine.models.hf_quant_config import HF_METHODS, hf_scheme
from engine.models.hf_quant_plan import HFQuantPlan
from engine.models.llama import CausalLM
from engine.models.llava import LlavaCausalLM, load_vision_arch
from engine.models.parallel import ShardLayout, check_ep_size
from engine.models.quant_linear import weights_choice
from engine.models.rotary import cos_sin_cache

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# One expert's projection: Qwen3-MoE (mlp.experts.E.gate_proj) or Mixtral
# (block_sparse_moe.experts.E.w1 = gate, w3 = up, w2 = down).
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}
_VOCAB_PARAMS = ("embed_tokens.weight", "lm_head.weight")

# (dim, start, stop): the part of a checkpoint tensor one rank reads; None: all of it.
Slice = tuple[int, int, int] | None
# Where a checkpoint tensor lands inside our parameter: None (all of it), (start, stop) rows of
# a fused parameter, or (expert, start, stop) rows of one expert in a stacked [E, ...] one.
Rows = tuple[int, int] | tuple[int, int, int] | None


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
    tp: TPGroup = SINGLE_RANK,
    ep: EPGroup = SINGLE_EP,
    quantization: str | None = None,
) -> CausalLM:
    check_ep_size(arch, ep.size)
    gguf = find_gguf(model_dir)
    vision = None if gguf is not None else load_vision_arch(model_dir)
    with torch.device("meta"):
        model = (CausalLM(arch, ops, max_positions, tp, ep) if vision is None
                 else LlavaCausalLM(arch, vision, ops, max_positions, tp, ep)).to(dtype)
    hf_quant = _hf_quantized(model_dir, gguf, model, device, dtype, quantization)
    quant = hf_quant if hf_quant is not None else _plan_quantized(gguf, arch, model, device, quantization)
    model = model.to_empty(device=device)
    # The rope table is derived, not loaded: rebuild it in fp32 (to_empty left it empty).
    model.cos_sin = cos_sin_cache(
        arch.rotary_dim, max_positions, arch.rope_theta, arch.rope_scaling_dict
    ).to(device)
    if arch.local_rope_theta is not None:
        model.cos_sin_local = cos_sin_cache(arch.rotary_dim, max_positions, arch.local_rope_theta, None).to(device)

    params = dict(model.named_parameters())
    layout = model.layout
    loaded: set[str] = set()
    # Quantized projections have no dense parameter, but their pieces map as if they had.
    targets = params if quant is None else {**params, **dict.fromkeys(quant.weights)}
    tensors = _checkpoint_tensors(model_dir, arch) if hf_quant is None else hf_quant.tensors()
    for name, read in tensors:
        for param_name, rows, src in _destinations(_text_name(name), layout, targets):
            if quant is not None and param_name in quant.weights:
                qw = quant.weights[param_name]
                qw.add(*(rows or (0, qw.out_features)), *quant.raw(name, src))
                continue
            dst = _rows_of(params[param_name].data, rows)
            tensor = read(src)
            if tensor.shape != dst.shape:
                raise ValueError(
                    f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            loaded.add(f"{param_name}:{rows}")
    expected = _expected_pieces(layout, params)
    missing = sorted(expected - loaded)
    if quant is not None:
        missing += sorted(name for name, qw in quant.weights.items() if not qw.covered())
    if missing:
        raise ValueError(f"checkpoint in {model_dir!r} is missing weights: {missing[:8]}")
    if arch.norm_plus_one and find_gguf(model_dir) is None:
        # Gemma's checkpoints store RMSNorm weights as w - 1 (transformers multiplies by
        # 1 + w, in fp32); llama.cpp's converter already added the 1 to a GGUF's.
        for name, p in params.items():
            if name.endswith("norm.weight"):
                p.data.copy_((p.data.float() + 1.0).to(p.dtype))
    if layout.vocab_rows < layout.vocab_per_rank:
        for name in _VOCAB_PARAMS:
            if name in params:
                params[name].data[layout.vocab_rows :].zero_()  # padding: zero embeddings and logits
    return model.eval()


def _plan_quantized(gguf: str | None, arch: ModelArch, model: torch.nn.Module, device: torch.device,
                    quantization: str | None) -> QuantPlan | None:
    """For a GGUF file (unless quantization="none", or quant_linear.weights_choice dequantizes
    by default at this ISA level): the projections that keep their blocks
    (engine.models.gguf_plan), each given its QuantWeight in place of a dense weight, so
    materialising the model allocates none for them."""
    if gguf is None:
        return None
    if quantization == "none":
        logger.info("GGUF weights: dequantized to fp32 at load (quantization=none)")
        return None
    plan = QuantPlan(gguf, arch)
    params = dict(model.named_parameters())
    plan.plan(model, lambda name: _destinations(_text_name(name), model.layout, params), device)
    if not plan.weights:
        return plan
    keep, why = weights_choice(device, quantization, sum(4 * w.out_features * w.in_features
                                                         for w in plan.weights.values()))
    if not keep:
        logger.info("GGUF weights: %s", why)
        return None
    for name, qw in plan.weights.items():
        module = model.get_submodule(name.rpartition(".")[0])
        module.weight = None
        module.quant = qw
    logger.info("GGUF weights: %d projections keep their quantized blocks, %s", len(plan.weights), why)
    return plan


def _hf_quantized(model_dir: str, gguf: str | None, model: torch.nn.Module, device: torch.device,
                  dtype: torch.dtype, quantization: str | None) -> HFQuantPlan | None:
    """For a safetensors checkpoint with a quantization_config: its reader
    (engine.models.hf_quant_plan), with the projections kept quantized (none on a GPU, or
    with quantization="none") each given its weight in place of a dense one."""
    if gguf is not None:
        if quantization in HF_METHODS:
            raise ParameterError("quantization", f"quantization={quantization!r} names a safetensors checkpoint's "
                                                 "quantization_config; a GGUF file takes 'gguf' or 'none'")
        return None
    scheme = hf_scheme(model_dir, quantization)
    if scheme is None:
        return None
    plan = HFQuantPlan(checkpoint_files(model_dir), scheme, keep=quantization != "none")
    params = dict(model.named_parameters())
    plan.plan(model, lambda name: _destinations(_text_name(name), model.layout, params), device)
    for name, qw in plan.weights.items():
        module = model.get_submodule(name.rpartition(".")[0])
        module.weight = None
        module.quant = qw
    why = ("int8 weights, int8 dynamic per-token activations" if scheme.int8_activations
           else "repacked exactly into GGUF blocks, fp32 products")
    logger.info("%s weights: %d of %d quantized projections kept (%s), the rest dequantized to %s at load",
                scheme.method, plan.kept_modules, len(plan.modules), why, str(dtype).removeprefix("torch."))
    if plan.half_tensors:
        logger.info("%s: held as stored in 16 bits, multiplied with fp32 sums", ", ".join(plan.half_tensors))
    return plan


def _checkpoint_tensors(model: str, arch: ModelArch) -> Iterator[tuple[str, Callable[[Slice], torch.Tensor]]]:
    """(HF tensor name, read(slice)) pairs; reading is deferred so skipped tensors cost
    nothing."""
    gguf = find_gguf(model)
    if gguf is not None:
        for name, read in gguf_tensors(gguf, arch):
            yield name, lambda src, read=read: _narrow(read(), src)
        return
    for path in checkpoint_files(model):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, lambda src, f=f, name=name: _read_safetensors(f, name, src)


def _read_safetensors(f, name: str, src: Slice) -> torch.Tensor:
    if src is None:
        return f.get_tensor(name)
    dim, start, stop = src
    part = f.get_slice(name)  # reads only the requested rows/columns from the file
    return part[start:stop] if dim == 0 else part[:, start:stop]


def _narrow(tensor: torch.Tensor, src: Slice) -> torch.Tensor:
    return tensor if src is None else tensor.narrow(src[0], src[1], src[2] - src[1])


# LLaVA checkpoints nest the LM (two layouts in the wild: transformers < 4.52 and after) and
# may nest CLIP's transformer under vision_model; our modules are flat.
_RENAMES = (
    ("language_model.model.", "model."), ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


def _text_name(name: str) -> str:
    for old, new in _RENAMES:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    return name.replace("vision_tower.vision_model.", "vision_tower.")


def _rows_of(param: torch.Tensor, rows: Rows) -> torch.Tensor:
    if rows is None:
        return param
    if len(rows) == 3:
        return param[rows[0], rows[1] : rows[2]]
    return param[rows[0] : rows[1]]


def _destinations(name: str, layout: ShardLayout, params: dict) -> list[tuple[str, Rows, Slice]]:
    """Where a HF tensor lands: (our parameter, row range inside a fused parameter, the slice of
    the checkpoint tensor this rank reads) for each piece; none when we do not use it. A tensor
    the checkpoint already fuses (Phi-3's qkv_proj, gate_up_proj) lands piece by piece, so each
    rank reads its heads of q, k and v (its rows of gate and up) from their own row ranges."""
    split = _split_fused(name, layout)
    if split is not None:
        return split
    target = _destination(name, layout, params)
    return [] if target is None else [target]


def _split_fused(name: str, layout: ShardLayout) -> list[tuple[str, Rows, Slice]] | None:
    """Phi-3's fused `self_attn.qkv_proj` ([q; k; v] rows) and `mlp.gate_up_proj` ([gate; up]
    rows): our parameters of the same names stack the same parts, this rank's share of each."""
    m = _LAYER.match(name)
    if m is None or m.group(2) not in ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"):
        return None
    arch, ours = layout.arch, f"layers.{m.group(1)}.{m.group(2)}"
    if m.group(2).startswith("mlp."):
        inter, whole, i0 = layout.intermediate_size, arch.intermediate_size, layout.rank * layout.intermediate_size
        return [(ours, (part * inter, (part + 1) * inter), (0, part * whole + i0, part * whole + i0 + inter))
                for part in (0, 1)]
    h, hkv, d = layout.num_heads, layout.num_kv_heads, arch.head_dim
    q0, kv0, k_at, v_at = layout.rank * h * d, layout.kv_head_start * d, arch.num_heads * d, \
        (arch.num_heads + arch.num_kv_heads) * d
    return [(ours, (0, h * d), (0, q0, q0 + h * d)),
            (ours, (h * d, (h + hkv) * d), (0, k_at + kv0, k_at + kv0 + hkv * d)),
            (ours, ((h + hkv) * d, (h + 2 * hkv) * d), (0, v_at + kv0, v_at + kv0 + hkv * d))]


def _destination(name: str, layout: ShardLayout, params: dict) -> tuple[str, Rows, Slice] | None:
    """Map a HF tensor name to (our parameter, row range inside a fused parameter, the slice
    of the checkpoint tensor this rank reads)."""
    arch, one_rank = layout.arch, layout.size == 1
    if name in ("lm_head.weight", "model.embed_tokens.weight"):
        if name == "lm_head.weight" and arch.tie_word_embeddings:
            return None
        src = None if one_rank else (0, layout.vocab_start, layout.vocab_start + layout.vocab_rows)
        return name.removeprefix("model."), _vocab_rows(layout), src
    if name == "model.norm.weight":
        return "norm.weight", None, None
    if name.startswith(("vision_tower.", "multi_modal_projector.")):
        return (name, None, None) if name in params else None  # replicated; later layers unused
    m = _LAYER.match(name)
    if m is None:
        return None
    layer, rest = m.group(1), m.group(2)
    prefix = f"layers.{layer}."
    expert = _EXPERT.match(rest)
    if expert is not None:
        return _expert_destination(prefix, int(expert.group(1)), _EXPERT_PART.get(expert.group(2)), layout)
    rest = rest.replace("block_sparse_moe.gate.", "mlp.gate.")  # Mixtral's router
    h, hkv, d, inter = layout.num_heads, layout.num_kv_heads, arch.head_dim, layout.intermediate_size
    q0, kv0, i0 = layout.rank * h * d, layout.kv_head_start * d, layout.rank * inter
    # module -> (fused parameter, its rows, rows of the checkpoint tensor this rank reads)
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", (0, h * d), (q0, q0 + h * d)),
        "self_attn.k_proj": ("self_attn.qkv_proj", (h * d, (h + hkv) * d), (kv0, kv0 + hkv * d)),
        "self_attn.v_proj": ("self_attn.qkv_proj", ((h + hkv) * d, (h + 2 * hkv) * d), (kv0, kv0 + hkv * d)),
        "mlp.gate_proj": ("mlp.gate_up_proj", (0, inter), (i0, i0 + inter)),
        "mlp.up_proj": ("mlp.gate_up_proj", (inter, 2 * inter), (i0, i0 + inter)),
    }
    # Row-parallel weights split their input columns; their biases are whole on every rank.
    row_parallel = {"self_attn.o_proj": (q0, q0 + h * d), "mlp.down_proj": (i0, i0 + inter)}
    module, _, kind = rest.rpartition(".")
    if module in fused:
        ours, rows, (start, stop) = fused[module]
        return f"{prefix}{ours}.{kind}", rows, None if one_rank else (0, start, stop)
    full = prefix + rest
    if full not in params:
        return None
    if module in row_parallel and kind == "weight" and not one_rank:
        return full, None, (1, *row_parallel[module])
    return full, None, None


def _expert_destination(prefix: str, expert: int, part: int | None, layout: ShardLayout):
    """Stack expert `expert`'s gate (part 0) and up (1) into w13[expert], its down (2) into
    w2[expert]. Under tensor parallelism each rank reads its slice of the intermediate dim
    (gate/up rows, down columns); under expert parallelism a rank reads its own experts whole,
    at their local index, and skips the rest."""
    if part is None:
        return None
    inter = layout.moe_intermediate_size
    if layout.ep_size > 1:
        expert -= layout.expert_start
        if not 0 <= expert < layout.num_local_experts:
            return None  # another rank's expert
        sliced = False
    else:
        sliced = layout.size > 1
    i0 = layout.rank * inter
    if part == 2:
        src = (1, i0, i0 + inter) if sliced else None
        return f"{prefix}mlp.w2", (expert, 0, layout.arch.hidden_size), src
    src = (0, i0, i0 + inter) if sliced else None
    return f"{prefix}mlp.w13", (expert, part * inter, (part + 1) * inter), src


def _vocab_rows(layout: ShardLayout) -> tuple[int, int] | None:
    """Rows of the local embedding/LM head the checkpoint fills (None: all; the rest is
    padding past the vocabulary on the last rank)."""
    return None if layout.vocab_rows == layout.vocab_per_rank or layout.size == 1 else (0, layout.vocab_rows)


def _expected_pieces(layout: ShardLayout, params: dict) -> set[str]:
    pieces = set()
    h, hkv, d, inter = layout.num_heads, layout.num_kv_heads, layout.arch.head_dim, layout.intermediate_size
    for name in params:
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            for rows in ((0, h * d), (h * d, (h + hkv) * d), ((h + hkv) * d, (h + 2 * hkv) * d)):
                pieces.add(f"{name}:{rows}")
        elif name.endswith("mlp.w13"):
            moe_inter = layout.moe_intermediate_size
            for e in range(layout.num_local_experts):
                pieces.update({f"{name}:{(e, 0, moe_inter)}", f"{name}:{(e, moe_inter, 2 * moe_inter)}"})
        elif name.endswith("mlp.w2"):
            pieces.update(f"{name}:{(e, 0, layout.arch.hidden_size)}" for e in range(layout.num_local_experts))
        elif "gate_up_proj" in name:
            for rows in ((0, inter), (inter, 2 * inter)):
                pieces.add(f"{name}:{rows}")
        elif name in _VOCAB_PARAMS:
            pieces.add(f"{name}:{_vocab_rows(layout)}")
        else:
            pieces.add(f"{name}:None")
    return pieces
