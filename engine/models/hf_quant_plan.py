"""Reading a quantized Hugging Face safetensors checkpoint (GPTQ, AWQ, compressed-tensors):
which projections stay quantized, and each projection's weight for the rest.

A quantized projection is stored as several tensors (GPTQ's `qweight`, `qzeros`, `scales`,
`g_idx`; compressed-tensors' `weight_packed`, `weight_scale`, ...) under its module's name.
The loader sees one tensor per projection, `<module>.weight`: read dense, it is the
checkpoint's own dequantization in fp32 (a projection not kept, or quantization="none");
kept, its GGUF blocks (engine.models.hf_quant_unpack) or int8 rows (engine.models.int8_linear).

Kept (CPU only, C kernels built): a parameter all of whose pieces repack exactly, whole or
split by output rows. A piece split by input columns (a row-parallel shard under tensor
parallelism) and anything that does not repack exactly are dequantized at load instead. The
LM head and embedding table, when left unquantized and stored in fp16 / bf16, are held as
stored (engine.models.half_linear) rather than widened to fp32.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
from safetensors import safe_open

from engine.models.half_linear import HalfWeight
from engine.models.hf_quant_config import HFQuantScheme
from engine.models.hf_quant_unpack import (
    GroupQuant,
    from_awq,
    from_compressed_tensors,
    from_gptq,
    to_blocks,
)
from engine.models.int8_linear import Int8Weight
from engine.models.parallel import ColumnParallelLinear, RowParallelLinear
from engine.models.quant_linear import QuantWeight

# The parameters the logits and the embedding read, which a checkpoint leaves unquantized
# unless it quantizes its head (gptqmodel's lm_head=True: then the head is kept as blocks).
_VOCAB_PARAMS = ("lm_head.weight", "embed_tokens.weight")
_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16}
Destinations = Callable[[str], list[tuple[str, tuple | None, tuple | None]]]
# The tensor that marks a module as quantized, and the parts read with it, per method.
_MARK = {"gptq": "qweight", "awq": "qweight", "compressed-tensors": "weight_scale"}
_PARTS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx",
                           "weight"),
}


class HFQuantPlan:
    """The quantized modules of a checkpoint, how to read them, and which stay quantized."""

    def __init__(self, files: list[str], scheme: HFQuantScheme, keep: bool) -> None:
        self.scheme, self.keep = scheme, keep
        self.weights: dict[str, QuantWeight | Int8Weight | HalfWeight] = {}
        self._where: dict[str, str] = {}  # checkpoint tensor -> its file
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                self._where.update(dict.fromkeys(f.keys(), path))
        mark = _MARK[scheme.method]
        self.modules = sorted(n.removesuffix("." + mark) for n in self._where if n.endswith("." + mark))
        quantized = set(self.modules)
        self._parts = {f"{m}.{p}" for m in quantized for p in _PARTS[scheme.method]}
        self._kept: dict[str, tuple] = {}  # "<module>.weight" -> what raw() hands the loader
        self._half: set[str] = set()  # checkpoint tensors held as stored, in 16 bits

    def _read(self, name: str) -> torch.Tensor:
        with safe_open(self._where[name], framework="pt", device="cpu") as f:
            return f.get_tensor(name)

    def group_quant(self, module: str) -> GroupQuant:
        """The checkpoint's integers and scales of one quantized module."""
        t = {p: self._read(f"{module}.{p}") for p in _PARTS[self.scheme.method] if f"{module}.{p}" in self._where}
        if self.scheme.method == "gptq":
            return from_gptq(t, self.scheme.bits, self.scheme.zero_offset)
        if self.scheme.method == "awq":
            return from_awq(t)
        return from_compressed_tensors(t, self.scheme.bits)

    def tensors(self) -> Iterator[tuple[str, Callable]]:
        """(HF tensor name, read(slice)) for the loader: plain tensors as stored, and one dense
        fp32 `<module>.weight` per quantized module (a module's parts are not listed)."""
        for name in self._where:
            if name in self._parts:
                continue
            yield name, lambda src, name=name: _narrow(self._read(name), src)
        for module in self.modules:
            yield f"{module}.weight", lambda src, module=module: _narrow(self.group_quant(module).dequantize(), src)

    def plan(self, model: torch.nn.Module, destinations: Destinations, device: torch.device) -> None:
        """Choose the parameters kept quantized and repack their pieces (held until `raw`)."""
        if not self.keep or device.type != "cpu":
            return
        from kernels.cpu.build import library

        if not self.scheme.int8_activations and library() is None:
            return
        linears = {f"{n}.weight": m for n, m in model.named_modules()
                   if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
        quantized, fills = defaultdict(list), defaultdict(int)
        for name in [n for n in self._where if n not in self._parts] + [f"{m}.weight" for m in self.modules]:
            for param, rows, src in destinations(name):
                fills[param] += 1
                if name.removesuffix(".weight") in self.modules:
                    quantized[param].append((name.removesuffix(".weight"), rows, src))
        for param, parts in quantized.items():
            # Every piece quantized (a fused parameter whose q is but v is not stays dense),
            # every row filled (not a head's vocabulary padding) and split, if at all, by rows.
            m = linears.get(param)
            if (m is None or len(parts) != fills[param] or any(s is not None and s[0] == 1 for _, _, s in parts)
                    or sum(m.out_features if r is None else r[1] - r[0] for _, r, _ in parts) != m.out_features):
                continue
            packed = {mod: self._pack(mod) for mod, _, _ in parts}
            if any(v is None for v in packed.values()):
                continue
            self.weights[param] = (Int8Weight if self.scheme.int8_activations else QuantWeight)(
                m.out_features, m.in_features)
            self._kept.update((f"{mod}.weight", v) for mod, v in packed.items())
        self._plan_half(model, destinations)

    def _plan_half(self, model: torch.nn.Module, destinations: Destinations) -> None:
        """The vocabulary tensors (LM head, embedding table) that stay unquantized and are stored
        in fp16 / bf16: held as stored (engine.models.half_linear), whole or split by rows."""
        from kernels.cpu.build import library

        if library() is None:
            return
        for name in (n for n in self._where if n not in self._parts):
            parts = destinations(name)
            if len(parts) != 1 or parts[0][0] not in _VOCAB_PARAMS or parts[0][0] in self.weights:
                continue
            dtype = _DTYPES.get(self._dtype(name))
            if dtype is None:
                continue
            param, rows, src = parts[0]
            module = model.get_submodule(param.rpartition(".")[0])
            out_features, in_features = module.weight.shape
            if (src is not None and src[0] == 1) or (rows is not None and rows != (0, out_features)):
                continue  # a rank's vocabulary padding rows are zeros the loader writes: dense
            self.weights[param] = HalfWeight(out_features, in_features, dtype)
            self._half.add(name)

    def _dtype(self, name: str) -> str:
        with safe_open(self._where[name], framework="pt", device="cpu") as f:
            return f.get_slice(name).get_dtype()

    @property
    def half_tensors(self) -> list[str]:
        """The checkpoint tensors held in their 16-bit form."""
        return sorted(self._half)

    @property
    def kept_modules(self) -> int:
        """How many of the checkpoint's quantized modules stay quantized."""
        return len(self._kept)

    def _pack(self, module: str) -> tuple | None:
        w = self.group_quant(module)
        if self.scheme.int8_activations:
            if w.zeros.shape[1] != 1 or not bool((w.zeros == 128).all()):
                return None  # W8A8 weights: symmetric, one scale per row
            return (w.q - 128).to(torch.int8), w.scales.float()
        return to_blocks(w)

    def raw(self, name: str, src: tuple | None) -> tuple:
        """What QuantWeight.add / Int8Weight.add / HalfWeight.add take after the rows: (GGUF
        type, uint8 rows, column order), (int8 rows, scales) or (16-bit rows,), this rank's rows
        (`src`, along dim 0)."""
        if name in self._half:
            return (_narrow(self._read(name), src),)
        packed = self._kept[name]
        if src is None:
            return packed
        _, start, stop = src
        if self.scheme.int8_activations:
            return packed[0][start:stop], packed[1][start:stop]
        qtype, data, perm = packed
        return qtype, data[start:stop].contiguous(), perm


def _narrow(tensor: torch.Tensor, src: tuple | None) -> torch.Tensor:
    return tensor if src is None else tensor.narrow(src[0], src[1], src[2] - src[1])
