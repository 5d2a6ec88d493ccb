"""Test factory: a random-weight HF checkpoint (make_model) rewritten as a GGUF file with the
`gguf` package's writer and quantizers, laid out as llama.cpp's converter lays it out. Types
the `gguf` package cannot quantize to (K-quants, IQ4_*) are written as random valid blocks of
the weights' magnitude: the model is then what those bytes decode to.

Written here, independently of engine/models: the parity tests compare our engine on the
file with transformers reading the same file, so a layout this writer gets wrong fails them.
"""

from __future__ import annotations

import json
import os

import numpy as np

# HF module -> GGUF tensor name (llama.cpp's names).
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
CONTROL, NORMAL = 3, 1  # gguf TokenType values


def gguf_name(hf_name: str) -> str:
    module, _, kind = hf_name.rpartition(".")
    if module in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)  # model.layers.N.<rest>
    return f"blk.{layer}.{_LAYER_NAMES[rest]}.{kind}"


def interleave_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's half-split rotary rows -> llama.cpp's pairs: per head, row i of the first half is
    followed by row i of the second half."""
    halves = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
    return halves.swapaxes(1, 2).reshape(w.shape)


# Types gguf-py can quantize; the others (K-quants, IQ4_*) it only decodes, and without
# llama.cpp's quantizer the factory writes random blocks for them (`random_weight`).
GGUF_QUANTIZES = ("BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# Byte offsets of each block's fp16 fields (d, and dmin or m), from ggml's block structs.
FP16_FIELDS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,),
    "IQ2_XXS": (0,),
}
# Affine types: value = d * scale * q - dmin * min (K-quants) or d * q + m. With each
# sub-block's min equal to its scale and dmin (or m) this multiple of d, a block is centred
# on zero as a real weight's is: d * scale * (q - (levels - 1) / 2). Random offsets would
# give every weight the same sign of mean, and the model one favourite token.
_CENTRING = {"Q4_1": -7.5, "Q5_1": -15.5, "Q2_K": 1.5, "Q4_K": 7.5, "Q5_K": 15.5}


def random_blocks(qtype: str, nblocks: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [nblocks, block bytes] of `qtype`: random bytes, the fp16 fields random finite
    fp16 bit patterns (any sign and exponent, subnormals included)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    _, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, (nblocks, nbytes), dtype=np.uint8)
    bits = rng.integers(0, 1 << 16, (nblocks, len(FP16_FIELDS[qtype])), dtype=np.uint16)
    bits[(bits >> 10 & 0x1F) == 0x1F] &= np.uint16(0xBFFF)  # an all-ones exponent is inf/NaN
    _set_fp16(blocks, qtype, bits.view(np.float16))
    return blocks


def _set_fp16(blocks: np.ndarray, qtype: str, values: np.ndarray) -> None:
    """Write `values` (float [nblocks, fields]) into every block's fp16 fields."""
    bits = np.ascontiguousarray(values, dtype=np.float16).view(np.uint8)  # [nblocks, 2 * fields]
    for i, start in enumerate(FP16_FIELDS[qtype]):
        blocks[:, start : start + 2] = bits[:, 2 * i : 2 * i + 2]


def _centre(blocks: np.ndarray, qtype: str) -> None:
    """Set each sub-block's min to its scale (see _CENTRING)."""
    if qtype == "Q2_K":  # bytes 0..15: a scale in the low nibble, its min in the high one
        blocks[:, :16] = (blocks[:, :16] & 0x0F) * 0x11
    elif qtype in ("Q4_K", "Q5_K"):
        # Bytes 4..15: the scales' bits are in 4..7 and the low nibbles of 12..15, the mins'
        # in 8..11 and the high nibbles.
        blocks[:, 8:12] = blocks[:, 4:8]
        blocks[:, 12:16] = (blocks[:, 12:16] & 0x0F) * 0x11


def random_weight(shape: tuple[int, int], qtype: str, std: float, rng: np.random.Generator) -> np.ndarray:
    """A [rows, cols] matrix of random `qtype` blocks (uint8 [rows, row bytes]) with values of
    RMS about `std` and mean about 0: random integer fields, centred (`_centre`), measured
    with gguf's decoder under unit scales, then scaled per block by std / RMS, jittered and
    of random sign."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    t = GGMLQuantizationType[qtype]
    values, nbytes = GGML_QUANT_SIZES[t]
    nblocks = shape[0] * shape[1] // values
    blocks = random_blocks(qtype, nblocks, rng)
    _centre(blocks, qtype)
    unit = np.array([1.0, _CENTRING.get(qtype, 0.0)])[: len(FP16_FIELDS[qtype])]
    _set_fp16(blocks, qtype, np.broadcast_to(unit, (nblocks, unit.size)))
    rms = float(np.sqrt(np.mean(dequantize(blocks, t) ** 2)))
    factor = std / rms * rng.uniform(0.5, 1.5, (nblocks, 1)) * rng.choice([-1.0, 1.0], (nblocks, 1))
    _set_fp16(blocks, qtype, factor * unit)
    return blocks.reshape(shape[0], shape[1] // values * nbytes)


def encode(w: np.ndarray, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, object]:
    """(data, raw_dtype for GGUFWriter.add_tensor): `w` quantized by gguf-py where it can,
    else random `qtype` blocks of `w`'s magnitude (the model is then what they decode to)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype == "F32":
        return w, None
    if qtype == "F16":
        return w.astype(np.float16), None
    t = GGMLQuantizationType[qtype]
    if qtype in GGUF_QUANTIZES:
        return quantize(w, t), t
    return random_weight(w.shape, qtype, float(np.sqrt(np.mean(w**2))), rng), t


def write_gguf(hf_dir: str, out_path: str, qtype: str = "F32", arch: str = "llama",
               general_name: str = "test model", skip: tuple[str, ...] = (),
               types: dict[str, str] | None = None, rope_freqs: np.ndarray | None = None,
               rope_linear: float | None = None) -> str:
    """Write `hf_dir` as GGUF. Matrices get `qtype`, or `types[name]` for a GGUF tensor name
    without `.weight` (`blk.0.ffn_down`) or else `types[kind]` for a tensor kind (`attn_q`,
    `ffn_down`, `token_embd`, ...), as llama.cpp mixes types in one file; 1-d tensors stay
    F32 (as llama.cpp keeps norms); q/k rows are interleaved for `llama` only. Types gguf-py
    cannot quantize are written as random blocks (`encode`), the same on every call.
    `rope_freqs`: llama.cpp's Llama-3 rope factor tensor; `rope_linear`: a linear rope scaling
    factor (rope.scaling.* keys)."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads

    w = gguf.GGUFWriter(out_path, arch)
    w.add_name(general_name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    if rope_linear is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_linear)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))

    tokens = [""] * cfg["vocab_size"]
    token_types = [NORMAL] * cfg["vocab_size"]
    for token, i in tok["model"]["vocab"].items():
        tokens[i] = token
    for added in tok["added_tokens"]:
        tokens[added["id"]] = added["content"]
        token_types[added["id"]] = CONTROL
    for i, t in enumerate(tokens):
        tokens[i] = t or f"[PAD{i}]"  # llama.cpp's filler for embedding rows past the vocabulary
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    with open(os.path.join(hf_dir, "chat_template.jinja")) as f:
        w.add_chat_template(f.read())

    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    types, rng = types or {}, np.random.default_rng(0)
    for name, value in tensors.items():
        if name in skip:
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            value = interleave_rotary(value, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            value = interleave_rotary(value, kv_heads)
        base = gguf_name(name).rpartition(".")[0]
        chosen = types.get(base, types.get(base.rpartition(".")[2], qtype))
        data, raw = encode(value, chosen if value.ndim == 2 else "F32", rng)
        w.add_tensor(gguf_name(name), data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path
