"""Test factory: a random-weight HF checkpoint (make_model) rewritten as a GGUF file with the
`gguf` package's writer and quantizers, laid out as llama.cpp's converter lays it out.

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


def encode(w: np.ndarray, qtype: str) -> tuple[np.ndarray, object]:
    """(data, raw_dtype for GGUFWriter.add_tensor)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype == "F32":
        return w, None
    if qtype == "F16":
        return w.astype(np.float16), None
    t = GGMLQuantizationType[qtype]
    return quantize(w, t), t


def write_gguf(hf_dir: str, out_path: str, qtype: str = "F32", arch: str = "llama",
               general_name: str = "test model", skip: tuple[str, ...] = (),
               types: dict[str, str] | None = None) -> str:
    """Write `hf_dir` as GGUF. Matrices get `qtype`, or `types[kind]` for a GGUF tensor kind
    (`attn_q`, `ffn_down`, `token_embd`, ...) as llama.cpp mixes types in one file; 1-d
    tensors stay F32 (as llama.cpp keeps norms); q/k rows are interleaved for `llama` only."""
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
    for name, value in tensors.items():
        if name in skip:
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            value = interleave_rotary(value, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            value = interleave_rotary(value, kv_heads)
        kind = gguf_name(name).split(".")[-2]
        data, raw = encode(value, (types or {}).get(kind, qtype) if value.ndim == 2 else "F32")
        w.add_tensor(gguf_name(name), data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path
