"""Test factory: a random-weight HF checkpoint (make_model) rewritten as a GGUF file with the
`gguf` package's writer and quantizers, laid out as llama.cpp's converter (convert_hf_to_gguf.py)
lays it out for llama, qwen2, qwen3, phi3, gemma2 and gemma3. Types the `gguf` package cannot
quantize to (K-quants, IQ4_*) are written as random valid blocks of the weights' magnitude (the
model is then what those bytes decode to), or, for llama.cpp's own mixes, made from an F32 file
by llama.cpp's quantizer (`llama_cpp_quantize`).

Written here, independently of engine/models: the parity tests compare our engine on the
file with transformers reading the same file, so a layout this writer gets wrong fails them.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

# HF module -> GGUF tensor name (llama.cpp's names). Phi-3's fused tensors keep their fusion.
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Gemma's four norms: HF's post_attention_layernorm follows attention (llama.cpp's
# post_attention_norm); llama.cpp's ffn_norm is the one before the MLP.
_GEMMA_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
CONTROL, NORMAL = 3, 1  # gguf TokenType values
GEMMA = ("gemma2", "gemma3")


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    module, _, kind = hf_name.rpartition(".")
    if module in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)  # model.layers.N.<rest>
    names = {**_LAYER_NAMES, **_GEMMA_NAMES} if arch in GEMMA else _LAYER_NAMES
    return f"blk.{layer}.{names[rest]}.{kind}"


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
    F32 (as llama.cpp keeps norms); q/k rows are interleaved for `llama` only; Gemma's norms
    get HF's 1 added. Types gguf-py cannot quantize are written as random blocks (`encode`),
    the same on every call. `rope_freqs`: llama.cpp's Llama-3 rope factor tensor;
    `rope_linear`: a linear rope scaling factor (rope.scaling.* keys)."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    w = gguf.GGUFWriter(out_path, arch)
    w.add_name(general_name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    extra = _phi3_keys(w, cfg) if arch == "phi3" else _head_keys(w, cfg, arch)
    if rope_linear is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_linear)
    if rope_freqs is not None:
        extra["rope_freqs.weight"] = rope_freqs
    for name, value in extra.items():
        w.add_tensor(name, np.asarray(value, dtype=np.float32))
    _add_tokenizer(w, hf_dir, cfg["vocab_size"])

    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    types, rng = types or {}, np.random.default_rng(0)
    for name, value in tensors.items():
        if name in skip or (arch in GEMMA and name == "lm_head.weight"):  # converter drops it
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            value = interleave_rotary(value, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            value = interleave_rotary(value, kv_heads)
        elif arch in GEMMA and name.endswith("norm.weight"):
            value = value + np.float32(1.0)  # HF stores w - 1; llama.cpp multiplies by w
        base = gguf_name(name, arch).rpartition(".")[0]
        chosen = types.get(base, types.get(base.rpartition(".")[2], qtype))
        data, raw = encode(value, chosen if value.ndim == 2 else "F32", rng)
        w.add_tensor(gguf_name(name, arch), data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def _rope_params(cfg: dict) -> tuple[dict, dict]:
    """(global, window-layer) rotary parameters of an HF config, old style (top-level keys and
    rope_scaling) or transformers 5's rope_parameters (per layer type for Gemma 3)."""
    params = cfg.get("rope_parameters") or {}
    full = {**params.get("full_attention", params), **(cfg.get("rope_scaling") or {})}
    full.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    local = params.get("sliding_attention") or {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    return full, local


def _head_keys(w, cfg: dict, arch: str) -> dict:
    """Head sizes and rotary of llama, qwen and Gemma files; Gemma's windows and caps."""
    import gguf

    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    full, local = _rope_params(cfg)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(full["rope_theta"])
    if arch not in GEMMA:
        w.add_rope_dimension_count(head_dim)
        return {}
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
        return {}
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_rope_freq_base_swa(local["rope_theta"])
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    pattern = cfg.get("sliding_window_pattern", 6)
    if pattern != 1:
        w.add_sliding_window(cfg["sliding_window"])
    if pattern not in (1, 6):
        # llama.cpp assumes Gemma 3's every-sixth-layer-global without this key (its converter
        # never writes it: real checkpoints all have 6); a test model's other pattern needs it.
        w.add_sliding_window_pattern(pattern)
    return {}


def _phi3_keys(w, cfg: dict) -> dict:
    """Phi-3 as llama.cpp's converter writes it: the rotated share of each head as the
    rotary dimension count, the pretraining length, and LongRoPE as two factor tensors plus
    the attention factor (no rope.scaling.type). Returns the factor tensors."""
    full, _ = _rope_params(cfg)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    partial = cfg.get("partial_rotary_factor") or full.get("partial_rotary_factor") or 1.0
    longest = cfg["max_position_embeddings"]
    original = cfg.get("original_max_position_embeddings") or full.get("original_max_position_embeddings") or longest
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_rope_dimension_count(int(partial * hidden) // heads)
    w.add_rope_freq_base(full["rope_theta"])
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    if not full.get("long_factor"):
        return {}
    scale = longest / original
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    return {"rope_factors_long.weight": full["long_factor"], "rope_factors_short.weight": full["short_factor"]}


def _add_tokenizer(w, hf_dir: str, vocab_size: int) -> None:
    """The HF byte-level BPE as llama.cpp's `gpt2` tokenizer, with the chat template."""
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    tokens = [""] * vocab_size
    token_types = [NORMAL] * vocab_size
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


def llama_cpp_quantize(src: str, out_path: str, ftype: str, allow_requantize: bool = False) -> str:
    """`src` quantized by llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize,
    what `llama-quantize` runs) to the file type `ftype` ('Q4_K_M', 'Q2_K', 'IQ4_XS', ...):
    llama.cpp chooses each tensor's type, falling back to another type for a matrix whose
    rows are no whole number of the type's blocks."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = min(4, os.cpu_count() or 1)
    params.allow_requantize = allow_requantize
    if llama_cpp.llama_model_quantize(src.encode(), out_path.encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src!r} to {ftype}")
    return out_path


def tensor_types(path: str) -> dict[str, str]:
    """GGUF tensor name -> its stored type's name, as gguf-py reads the file."""
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
