"""A Hugging Face checkpoint's `quantization_config` (config.json), read into one frozen scheme.

Which method a safetensors checkpoint is quantized with comes from the checkpoint, as in vLLM;
`quantization=` may name the same method (or "none": dequantize every projection to fp32 at
load) but never a different one. Anything we cannot multiply exactly is refused here, before a
tensor is read, with the field and what is supported: the tensors themselves say which modules
are quantized (a module listed in `modules_to_not_convert` or `ignore` keeps a dense `weight`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from engine.errors import ParameterError

# vLLM's names for the methods we read (engine.config.QUANTIZATION_METHODS adds gguf and none).
HF_METHODS = ("gptq", "awq", "compressed-tensors")
GPTQ_BITS = (4, 8)
# auto-gptq's and gptqmodel's v1 format stores each zero point less one (the classic offset);
# gptqmodel's internal v2 stores it as is.
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 2}
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")


@dataclass(frozen=True)
class HFQuantScheme:
    """What the loader needs to unpack a quantized projection's tensors.

    method: one of HF_METHODS. bits: 4 or 8 (GPTQ/AWQ weights, compressed-tensors weights).
    zero_offset: added to each stored zero point (1 for GPTQ v1, else 0). int8_activations:
    compressed-tensors W8A8, activations rounded to int8 per token at run time."""

    method: str
    bits: int
    zero_offset: int = 0
    int8_activations: bool = False

    def __post_init__(self) -> None:
        if self.method not in HF_METHODS:
            raise ParameterError("quantization", f"quantization must be one of {HF_METHODS}, got {self.method!r}")


def _refuse(field: str, value, allowed) -> ParameterError:
    return ParameterError("quantization", f"quantization_config.{field} = {value!r} is not supported; "
                                          f"supported: {allowed}")


def read_quantization_config(model_dir: str) -> dict | None:
    """The checkpoint's `quantization_config` (config.json, or a LLaVA's text_config), else an
    AutoGPTQ checkpoint's quantize_config.json (older ones have only that), or None."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        cfg = json.load(f)
    qc = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
    legacy = os.path.join(model_dir, "quantize_config.json")
    if qc is None and os.path.isfile(legacy):
        with open(legacy) as f:
            qc = {"quant_method": "gptq", **json.load(f)}
    return qc


def hf_scheme(model_dir: str, quantization: str | None) -> HFQuantScheme | None:
    """The checkpoint's scheme (also under quantization="none", which dequantizes it), None for
    a dense checkpoint; raises ParameterError (field `quantization`) for a method or setting we
    do not read."""
    qc = read_quantization_config(model_dir)
    if qc is None:
        if quantization in HF_METHODS:
            raise ParameterError("quantization", f"quantization={quantization!r} needs a checkpoint with a "
                                                 f"quantization_config of that method; {model_dir!r} has none")
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in HF_METHODS:
        raise _refuse("quant_method", qc.get("quant_method"), HF_METHODS)
    if quantization not in (None, "none", method):
        raise ParameterError("quantization", f"quantization={quantization!r} does not match the checkpoint's "
                                             f"quantization_config.quant_method {method!r}")
    return {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors}[method](qc)


def _gptq(qc: dict) -> HFQuantScheme:
    bits = qc.get("bits")
    if bits not in GPTQ_BITS:
        raise _refuse("bits", bits, GPTQ_BITS)
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if fmt not in GPTQ_FORMATS:
        raise _refuse("checkpoint_format", fmt, tuple(GPTQ_FORMATS))
    if qc.get("dynamic"):
        raise _refuse("dynamic", "(per-module overrides)", "one scheme for every module")
    return HFQuantScheme("gptq", bits, zero_offset=1 if GPTQ_FORMATS[fmt] == 1 else 0)


def _awq(qc: dict) -> HFQuantScheme:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _refuse("bits", bits, (4,))
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("version", qc.get("version"), ("gemm",))
    if not qc.get("zero_point", True):
        raise _refuse("zero_point", False, (True,))
    return HFQuantScheme("awq", 4)


def _compressed_tensors(qc: dict) -> HFQuantScheme:
    fmt = qc.get("format")
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise _refuse("config_groups", qc.get("config_groups"), "at least one group")
    schemes = set()
    for group in groups:
        weights, acts = group.get("weights") or {}, group.get("input_activations")
        gfmt = group.get("format") or fmt
        for what, spec in (("weights", weights), ("input_activations", acts or {})):
            if spec.get("type", "int") == "float":
                raise ParameterError("quantization", f"compressed-tensors {what} of type float (FP8/FP4) are not "
                                                     "supported on CPU; supported: int4 W4A16 (pack-quantized) "
                                                     "and int8 W8A8 (int-quantized)")
        if gfmt not in CT_FORMATS:
            raise _refuse("format", gfmt, CT_FORMATS)
        bits = weights.get("num_bits")
        if (gfmt == "pack-quantized") != (bits == 4) or bits not in (4, 8):
            raise _refuse("config_groups.weights.num_bits", bits, "4 (pack-quantized) or 8 (int-quantized)")
        if weights.get("strategy") not in ("group", "channel"):
            raise _refuse("config_groups.weights.strategy", weights.get("strategy"), ("group", "channel"))
        if bits == 8 and not weights.get("symmetric", True):
            raise _refuse("config_groups.weights.symmetric", False, "symmetric int8 weights")
        if acts:
            if bits != 8 or acts.get("num_bits") != 8 or not acts.get("dynamic") or acts.get("strategy") != "token" \
                    or not acts.get("symmetric", True):
                raise _refuse("config_groups.input_activations", acts,
                              "none (W4A16), or int8 symmetric dynamic per-token with int8 weights (W8A8)")
        schemes.add((bits, bool(acts)))
    if len(schemes) != 1:
        raise _refuse("config_groups", sorted(schemes), "one scheme for every group")
    bits, int8_acts = schemes.pop()
    return HFQuantScheme("compressed-tensors", bits, int8_activations=int8_acts)
