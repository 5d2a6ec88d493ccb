"""A Llama decoder stack over GGUF-block weights in one C call (kernels/cpu/decode_stack.c).

Contract:

    DecodeStack(dims: StackDims, layers: list[StackLayer], cos_sin [P, rot] fp32,
                final_norm [hidden] fp32)
    stack(x [T, hidden] fp32, positions [T] int64, slot_mapping [T] int64,
          block_table [R, B] int32, query_start_loc [R + 1] int32, seq_lens [R] int32,
          kv_caches: per layer (key_cache, value_cache), each [blocks, block_size, Hkv, D] fp32)
        -> [T, hidden] fp32: for each layer, in order,
              h = rms_norm(x, input_norm) (the residual add fused as in kernels.reference),
              q, k, v = split(h @ Wqkv^T); neox rotary on q, k at positions;
              k, v written to the caches at slot_mapping (-1 skipped);
              o = paged_attention(q over the caches, causal within each row's run) @ Wo^T;
              h = rms_norm(o + residual, post_attention_norm);
              x = (silu(h @ Wgate^T) * (h @ Wup^T)) @ Wdown^T;
           then rms_norm(x + residual, final_norm).
        The kernels are those of kernels.cpu and kernels.cpu.quant, called with the same
        arguments as the model's layers call them one by one, so the result is bit-identical to
        that path. Every query run must be at most MAX_QUERY_LEN tokens (the C attention's
        limit); the caller checks (`accepts`).

Weights are borrowed: the caller keeps every tensor it passes alive and unmoved while the
stack is used (the model owns them; kv caches are re-read when their storage changes).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels.cpu import NATIVE_MAX_QUERY_LEN, quant
from kernels.cpu.build import library

MAX_QUERY_LEN = NATIVE_MAX_QUERY_LEN
MAX_SEGMENTS = 4  # decode_stack.c's MAX_SEGMENTS: row segments of differing block types
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class _Segment(ctypes.Structure):
    _fields_ = [("start", _I64), ("rows", _I64), ("row_bytes", _I64), ("type", _I64), ("data", _PTR)]


class _Projection(ctypes.Structure):
    _fields_ = [("num_segments", _I64), ("in_features", _I64), ("out_features", _I64),
                ("seg", _Segment * MAX_SEGMENTS)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _PTR), ("post_attention_norm", _PTR), ("key_cache", _PTR), ("value_cache", _PTR),
                ("qkv", _Projection), ("o", _Projection), ("gate_up", _Projection), ("down", _Projection)]


class _Model(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                          "rotary_dim", "block_size", "max_query_len", "method", "num_threads")] + [
        ("eps", ctypes.c_double), ("scale", ctypes.c_double), ("cos_sin", _PTR), ("final_norm", _PTR),
        ("layers", _PTR)]


@dataclass(frozen=True)
class StackDims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


# A projection: its row segments as (first output row, qtype, uint8 [rows, row bytes] blocks).
Segments = list[tuple[int, str, torch.Tensor]]


@dataclass
class StackLayer:
    input_norm: torch.Tensor  # [hidden] fp32
    post_attention_norm: torch.Tensor
    qkv: Segments  # [(heads + 2 kv_heads) head_dim, hidden]
    o: Segments  # [hidden, heads head_dim]
    gate_up: Segments  # [2 intermediate, hidden]: gate rows, then up rows
    down: Segments  # [hidden, intermediate]


def _check_vector(t: torch.Tensor, n: int, what: str) -> None:
    if t.dtype != torch.float32 or t.shape != (n,) or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{what} must be fp32 [{n}] contiguous on CPU, got {t.dtype} {tuple(t.shape)}")


def _projection(segments: Segments, in_features: int, out_features: int, what: str) -> _Projection:
    if not 1 <= len(segments) <= MAX_SEGMENTS:
        raise ValueError(f"{what}: 1 to {MAX_SEGMENTS} row segments, got {len(segments)}")
    p = _Projection(len(segments), in_features, out_features)
    at = 0
    for i, (start, qtype, data) in enumerate(sorted(segments, key=lambda s: s[0])):
        if start != at or not quant.supported(qtype, in_features):
            raise ValueError(f"{what}: segment at row {start} ({qtype}) is not the next one ({at}) or has no kernel")
        quant._check_weight(data, qtype, in_features)
        p.seg[i] = _Segment(start, data.shape[0], data.shape[1], quant.QTYPES[qtype][0], data.data_ptr())
        at += data.shape[0]
    if at != out_features:
        raise ValueError(f"{what}: segments cover {at} rows of {out_features}")
    return p


class DecodeStack:
    def __init__(self, dims: StackDims, layers: list[StackLayer], cos_sin: torch.Tensor,
                 final_norm: torch.Tensor) -> None:
        lib = library()
        if lib is None:
            raise RuntimeError("the native CPU kernels are not available")
        d = dims
        if min(d.hidden, d.heads, d.kv_heads, d.head_dim, d.intermediate) <= 0 or d.heads % d.kv_heads:
            raise ValueError(f"bad stack dimensions {d}")
        if d.hidden % 8 or d.head_dim % 8 or d.intermediate % 8 or d.heads * d.head_dim > 16384:
            raise ValueError(f"hidden, head_dim and intermediate must be multiples of 8, heads x head_dim <= 16384: {d}")
        rot = cos_sin.shape[-1]
        if (cos_sin.dtype != torch.float32 or cos_sin.dim() != 2 or not cos_sin.is_contiguous()
                or (rot // 2) % 8 or rot > d.head_dim):
            raise ValueError(f"cos_sin must be fp32 [positions, rot] contiguous with rot / 2 a multiple of 8, "
                             f"rot <= head_dim; got {cos_sin.dtype} {tuple(cos_sin.shape)}")
        _check_vector(final_norm, d.hidden, "final_norm")
        self.dims, self._lib = d, lib
        q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
        self._layers = (_Layer * len(layers))()
        for i, L in enumerate(layers):
            _check_vector(L.input_norm, d.hidden, f"layer {i} input_norm")
            _check_vector(L.post_attention_norm, d.hidden, f"layer {i} post_attention_norm")
            self._layers[i] = _Layer(
                L.input_norm.data_ptr(), L.post_attention_norm.data_ptr(), None, None,
                _projection(L.qkv, d.hidden, q + 2 * kv, f"layer {i} qkv"),
                _projection(L.o, q, d.hidden, f"layer {i} o"),
                _projection(L.gate_up, d.hidden, 2 * d.intermediate, f"layer {i} gate_up"),
                _projection(L.down, d.intermediate, d.hidden, f"layer {i} down"))
        self._model = _Model(len(layers), d.hidden, d.heads, d.kv_heads, d.head_dim, d.intermediate, rot, 0,
                             MAX_QUERY_LEN, 0, 1, d.eps, d.scale, cos_sin.data_ptr(), final_norm.data_ptr(),
                             ctypes.cast(self._layers, _PTR))
        self._caches: tuple[int, ...] = ()
        self._scratch = torch.empty(0, dtype=torch.float32)

    def _bind_caches(self, kv_caches) -> None:
        """Points the layers at the caches (again only when their storage moved)."""
        ptrs = tuple(t.data_ptr() for kv in kv_caches for t in kv)
        if ptrs == self._caches:
            return
        d = self.dims
        if len(kv_caches) != len(self._layers):
            raise ValueError(f"{len(kv_caches)} kv caches for {len(self._layers)} layers")
        for i, (k, v) in enumerate(kv_caches):
            for c in (k, v):
                if (c.dtype != torch.float32 or c.dim() != 4 or c.shape[2:] != (d.kv_heads, d.head_dim)
                        or not c.is_contiguous() or c.device.type != "cpu"):
                    raise ValueError(f"layer {i}'s kv caches must be fp32 [blocks, block_size, {d.kv_heads}, "
                                     f"{d.head_dim}] contiguous on CPU, got {c.dtype} {tuple(c.shape)}")
            self._layers[i].key_cache, self._layers[i].value_cache = k.data_ptr(), v.data_ptr()
        self._model.block_size = kv_caches[0][0].shape[1]
        self._caches = ptrs

    def __call__(self, x, positions, slot_mapping, block_table, query_start_loc, seq_lens, kv_caches) -> torch.Tensor:
        T, d = x.shape[0], self.dims
        if (x.dtype != torch.float32 or x.shape != (T, d.hidden) or not x.is_contiguous()
                or positions.dtype != torch.int64 or positions.shape != (T,) or not positions.is_contiguous()
                or slot_mapping.dtype != torch.int64 or slot_mapping.shape != (T,) or not slot_mapping.is_contiguous()
                or block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.stride(-1) != 1
                or query_start_loc.dtype != torch.int32 or not query_start_loc.is_contiguous()
                or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous()
                or query_start_loc.shape[0] != seq_lens.shape[0] + 1 or block_table.shape[0] < seq_lens.shape[0]):
            raise ValueError("decode stack inputs: x fp32 [T, hidden], positions and slot_mapping int64 [T], "
                             "block_table int32 [R, B], query_start_loc int32 [R + 1], seq_lens int32 [R], "
                             f"contiguous; got x {x.dtype} {tuple(x.shape)}, positions {positions.dtype} "
                             f"{tuple(positions.shape)}, seq_lens {tuple(seq_lens.shape)}")
        self._bind_caches(kv_caches)
        m = self._model
        m.method, m.num_threads = quant.METHODS["auto"], torch.get_num_threads()
        need = self._lib.decode_stack_scratch(ctypes.addressof(m), T)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        out = torch.empty((T, d.hidden), dtype=torch.float32)
        if T:
            self._lib.decode_stack_f32(ctypes.addressof(m), x.data_ptr(), T, positions.data_ptr(), slot_mapping.data_ptr(),
                                       block_table.data_ptr(), block_table.stride(0), query_start_loc.data_ptr(),
                                       seq_lens.data_ptr(), seq_lens.shape[0], out.data_ptr(),
                                       self._scratch.data_ptr())
        return out
