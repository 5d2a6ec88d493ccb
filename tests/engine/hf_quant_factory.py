"""Quantized Hugging Face checkpoints made from a dense tiny model, in each method's documented
tensor layout (GPTQ: auto-gptq's v1 packing; AWQ: AutoAWQ's GEMM packing; compressed-tensors:
its own pack_to_int32), and beside each the dense fp32 checkpoint of the same weights
dequantized from the integers before packing: the oracle transformers loads.

Weights are rounded to the nearest step per group (no calibration: what is tested is the
format, not the quantizer)."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _rtn(w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor, scale_dtype: torch.dtype):
    """Round w [N, K] per group: (q [N, K], zeros [N, G], scales [N, G]) with
    w ~ scales * (q - zeros), q in [0, 2^bits)."""
    n, k = w.shape
    groups = k // group if group > 0 else 1
    top = (1 << bits) - 1
    wg = torch.stack([w[:, g_idx == g] for g in range(groups)], dim=1)  # [N, G, cols]
    if sym:
        scales = (wg.abs().amax(dim=2) / (top // 2 + 0.5)).clamp_min(1e-6)
        zeros = torch.full((n, groups), (top + 1) // 2, dtype=torch.int32)
    else:
        lo, hi = wg.amin(dim=2).clamp(max=0), wg.amax(dim=2).clamp(min=0)
        scales = ((hi - lo) / top).clamp_min(1e-6)
        zeros = torch.round(-lo / scales).clamp(1, top).to(torch.int32)  # >= 1: GPTQ v1 stores zero - 1
    scales = scales.to(scale_dtype)
    q = torch.round(w / scales.float()[:, g_idx]) + zeros[:, g_idx]
    return q.clamp(0, top).to(torch.int32), zeros, scales


def _pack(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """int values -> int32 words, 32 // bits along `dim`, value i (or order[i]) at bits i*bits."""
    per = 32 // bits
    v = values.to(torch.int64)
    if dim == 0:
        v = v.T
    v = v.reshape(v.shape[0], -1, per)
    if order is not None:
        v = v[:, :, list(order)]
    words = (v << (torch.arange(per) * bits)).sum(dim=2)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.T.contiguous() if dim == 0 else words.contiguous()


def _write(src: str, out: str, tensors: dict, qconfig: dict | None) -> str:
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(src, name), out)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if qconfig is not None:
        cfg["quantization_config"] = qconfig
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "model.safetensors"))
    return out


def write_quantized(src: str, out: str, method: str, bits: int = 4, group: int = 128, sym: bool = True,
                    desc_act: bool = False, seed: int = 0, oracle: bool = True, v2: bool = False,
                    w8a8: bool = True, dense_dtype: torch.dtype = torch.float32,
                    lm_head: bool = False) -> tuple[str, str | None]:
    """(quantized checkpoint dir, dense fp32 oracle dir or None without `oracle`) of the
    dense model in `src`.
    method: gptq (v1 format, or gptq_v2 with `v2`), awq, ct (compressed-tensors pack-quantized
    int4, or int-quantized int8 when bits == 8: W8A8, or W8A16 without `w8a8`).
    dense_dtype: what the tensors left unquantized are stored in (real checkpoints: fp16 or
    bf16; the oracle holds the same values in fp32). lm_head: the head quantized too (GPTQ,
    gptqmodel's `lm_head: true`)."""
    dense = {k: v.float() for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
    gen = torch.Generator().manual_seed(seed)
    quant, dequantized = {}, dict(dense)
    projections = PROJECTIONS + (("lm_head",) if lm_head else ())
    for name, w in dense.items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rpartition(".")[2] not in projections:
            quant[name] = w.to(dense_dtype)
            dequantized[name] = quant[name].float()
            continue
        n, k = w.shape
        gs = group if group > 0 else k
        g_idx = torch.arange(k) // gs
        if desc_act:
            g_idx = g_idx[torch.randperm(k, generator=gen)]
        scale_dtype = torch.bfloat16 if method == "ct" else torch.float16
        q, zeros, scales = _rtn(w, bits, gs, sym, g_idx, scale_dtype)
        dequantized[name] = scales.float()[:, g_idx] * (q - zeros[:, g_idx]).float()
        if method == "gptq":
            quant[f"{module}.qweight"] = _pack(q.T, bits, 0)
            quant[f"{module}.qzeros"] = _pack(zeros.T - (0 if v2 else 1), bits, 1)  # v1: zero - 1
            quant[f"{module}.scales"] = scales.T.contiguous()
            quant[f"{module}.g_idx"] = g_idx.to(torch.int32)
        elif method == "awq":
            quant[f"{module}.qweight"] = _pack(q.T, 4, 1, AWQ_ORDER)
            quant[f"{module}.qzeros"] = _pack(zeros.T, 4, 1, AWQ_ORDER)
            quant[f"{module}.scales"] = scales.T.contiguous()
        elif bits == 4:
            from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

            half = 1 << (bits - 1)
            quant[f"{module}.weight_packed"] = pack_to_int32((q - half).to(torch.int8), 4)
            quant[f"{module}.weight_shape"] = torch.tensor([n, k])
            quant[f"{module}.weight_scale"] = scales
            if not sym:
                quant[f"{module}.weight_zero_point"] = pack_to_int32((zeros - half).to(torch.int8), 4, packed_dim=0)
            if desc_act:
                quant[f"{module}.weight_g_idx"] = g_idx.to(torch.int32)
        else:
            quant[f"{module}.weight"] = (q - 128).to(torch.int8)
            quant[f"{module}.weight_scale"] = scales
    qconfig = _config(method, bits, group, sym, desc_act, v2, w8a8)
    if lm_head:
        qconfig["lm_head"] = True
    return _write(src, out, quant, qconfig), _write(src, out + "-dense", dequantized, None) if oracle else None


def _config(method: str, bits: int, group: int, sym: bool, desc_act: bool, v2: bool, w8a8: bool) -> dict:
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
                "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
               "strategy": "group" if group > 0 else "channel", "group_size": group if group > 0 else None,
               "actorder": "group" if desc_act else None}
    acts = None
    if bits == 8 and w8a8:
        acts = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized" if bits == 4 else "int-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}
