"""Which projections of a GGUF checkpoint stay in their blocks (engine.models.quant_linear).

Decided from the file's tensor types before the model is materialised, so a projection kept
quantized never gets a dense weight. A parameter is kept when every checkpoint piece that
fills it is of a block type a kernel multiplies, at this rank's width; float tensors, types
without a kernel, and pieces that would cut a block (a row-parallel split inside a block, or
vocabulary padding rows) are dequantized at load as before.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch

from engine.models.arch import ModelArch
from engine.models.gguf_file import PERMUTED_QK, ROPE_TENSORS, gguf_architecture, open_gguf
from engine.models.gguf_quants import block_shape, is_float_type
from engine.models.gguf_weights import hf_name, unpermute_rotary
from engine.models.parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from engine.models.quant_linear import QuantWeight, kernel_supports

# (our parameter, its rows a piece fills or None, the slice of the checkpoint tensor read)
Destinations = Callable[[str], list[tuple[str, tuple | None, tuple | None]]]


class QuantPlan:
    """The parameters kept quantized (name -> its QuantWeight, to fill) and how to read a
    checkpoint tensor's raw rows for them."""

    def __init__(self, path: str, arch: ModelArch) -> None:
        reader = open_gguf(path)
        file_arch = gguf_architecture(path)
        permuted = file_arch in PERMUTED_QK
        self.weights: dict[str, QuantWeight] = {}
        self._tensors = {}  # HF name -> (GGUF tensor, heads to un-permute or None)
        for t in reader.tensors:
            if t.name in ROPE_TENSORS:
                continue
            name = hf_name(t.name, file_arch)
            heads = {".q_proj.": arch.num_heads, ".k_proj.": arch.num_kv_heads}
            self._tensors[name] = (t, next((h for k, h in heads.items() if k in name), None) if permuted else None)

    def plan(self, model: torch.nn.Module, destinations: Destinations, device: torch.device) -> None:
        modules = {f"{n}.weight": m for n, m in model.named_modules()
                   if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding))}
        pieces = defaultdict(list)
        for name, (t, _) in self._tensors.items():
            for param, rows, src in destinations(name):
                if param in modules:
                    pieces[param].append((t.tensor_type.name, rows, src))
        for param, parts in pieces.items():
            m = modules[param]
            embedding = isinstance(m, VocabParallelEmbedding)
            n, k = (m.num_embeddings, m.embedding_dim) if embedding else (m.out_features, m.in_features)
            if all(_fits(qtype, k, rows, src, embedding, device) for qtype, rows, src in parts):
                self.weights[param] = QuantWeight(n, k, device=device)

    def raw(self, name: str, src: tuple | None) -> tuple[str, torch.Tensor]:
        """(block type, uint8 [rows, row bytes]) of checkpoint tensor `name`, sliced by `src`
        as the dense path narrows it (rows, or whole blocks of columns)."""
        t, rotary_heads = self._tensors[name]
        qtype = t.tensor_type.name
        rows = int(t.shape[-1]) if len(t.shape) > 1 else 1
        data = torch.from_numpy(np.asarray(t.data).reshape(-1).view(np.uint8)).view(rows, -1)
        if rotary_heads is not None:
            data = unpermute_rotary(data, rotary_heads)  # a permutation of whole rows
        if src is not None:
            dim, start, stop = src
            if dim == 0:
                data = data[start:stop]
            else:
                values, nbytes = block_shape(qtype)
                data = data[:, start // values * nbytes : stop // values * nbytes]
        return qtype, data


def _fits(qtype: str, k: int, rows, src, embedding: bool, device: torch.device) -> bool:
    if is_float_type(qtype) or not kernel_supports(qtype, k, device):
        return False
    if embedding and rows is not None:
        return False  # the last rank's padding rows past the vocabulary stay dense zeros
    if src is not None and src[0] == 1:
        values = block_shape(qtype)[0]
        return src[1] % values == 0 and src[2] % values == 0
    return True
