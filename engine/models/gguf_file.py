"""GGUF checkpoints: which path is one, and its metadata as the config our model reads.

A model path names a GGUF checkpoint when it is a `.gguf` file, or a directory without a
config.json that holds exactly one `.gguf` file. Everything else is a Hugging Face directory.
The metadata is turned into a Hugging Face style config dict, so one validator
(`arch.arch_from_dict`) covers both formats. Where a file leaves a value out, we use the one
llama.cpp's loader assumes for that architecture, since llama.cpp defines what a GGUF file means.
"""

from __future__ import annotations

import functools
import glob
import os

import numpy as np

from engine.errors import ParameterError
from engine.models.rotary import FREQ_FACTORS, LONGROPE

# general.architecture -> the Hugging Face class whose layout our model implements. There is
# no `mistral` GGUF architecture: llama.cpp writes Mistral models as `llama` (the same layout;
# GGUF keeps no sliding window), and gguf-py and transformers know no other spelling.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# NOTE: llama.cpp runs its `llama` architecture with interleaved (GPT-J) rotary, so its
# converter permutes the rows of each q/k head to make that equivalent to HF's half-split
# rotary. Only these architectures carry the permutation; our rotary is HF's, so the loader
# undoes it (gguf_weights.py). Qwen2/Qwen3, Phi-3 and Gemma run half-split (NeoX) rotary in
# llama.cpp, unpermuted.
PERMUTED_QK = ("llama",)
# Tensors that are not weights but rotary parameters, read here: Llama 3.x's per-frequency
# divisors, Phi-3's LongRoPE factor sets.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# Gemma's sliding-window layers when the file names no pattern, as llama.cpp's loader assumes:
# the last of every n layers is global (Gemma 2: every other layer, the first windowed).
_GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
# The 27B models' layer counts: llama.cpp (after gemma_pytorch) scales their scores by
# hidden / heads, every other size's by head_dim; HF configs spell it query_pre_attn_scalar.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_MISSING = object()


def find_gguf(model: str) -> str | None:
    """The GGUF file `model` names, or None for a Hugging Face directory. Raises
    ParameterError('model') for a path that does not exist, a non-GGUF file, or a
    directory with several GGUF files."""
    if not isinstance(model, str) or not os.path.exists(model):
        raise ParameterError("model", f"model {model!r} does not exist; give a Hugging Face model "
                             f"directory, a .gguf file or a directory holding one .gguf file")
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ParameterError("model", f"model {model!r} is a file but not a .gguf file; give a "
                                 f".gguf file or a model directory")
        return model
    if os.path.isfile(os.path.join(model, "config.json")):
        return None
    found = sorted(glob.glob(os.path.join(model, "*.gguf")))
    if len(found) > 1:
        names = [os.path.basename(p) for p in found]
        raise ParameterError("model", f"model directory {model!r} holds {len(found)} .gguf files "
                             f"{names}; name one of them as the model")
    return found[0] if found else None


@functools.lru_cache(maxsize=4)
def open_gguf(path: str):
    """One reader per file and process: parsing a file's metadata takes seconds (a 49k-token
    vocabulary is ~150k small fields), and the arch, the weights and the EOS ids all need it."""
    from gguf import GGUFReader

    # Copy-on-write mapping: tensors viewed from it are writable numpy arrays, which torch
    # wraps without a copy (and without warning); the file itself is never written.
    reader = GGUFReader(path, "c")
    if reader.byte_order != "I":
        raise ParameterError("model", f"{path!r} is a byte-swapped (big-endian) GGUF file; only "
                             f"little-endian files are supported")
    return reader


def metadata(path: str, key: str, default=_MISSING):
    field = open_gguf(path).get_field(key)
    if field is None:
        if default is _MISSING:
            raise ParameterError("model", f"GGUF file {path!r} has no {key!r} metadata")
        return default
    return field.contents()


def gguf_architecture(path: str) -> str:
    arch = metadata(path, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ParameterError("model", f"GGUF architecture {arch!r} of {path!r} is not supported; "
                             f"supported: {sorted(GGUF_ARCHITECTURES)}")
    return arch


def gguf_config(path: str) -> dict:
    """The file's metadata as a Hugging Face config dict (the keys arch_from_dict reads)."""
    arch = gguf_architecture(path)

    def get(key, default=_MISSING):
        return metadata(path, f"{arch}.{key}", default)

    tensors = {t.name: t for t in open_gguf(path).tensors}
    if "token_embd.weight" not in tensors:
        raise ParameterError("model", f"GGUF file {path!r} has no token_embd.weight tensor")
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    config = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        # GGUF dimensions are innermost first: the embedding is [hidden, vocab].
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        # llama.cpp drops output.weight when the head shares the embedding.
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }
    partial = _partial_rotary(path, arch, int(get("rope.dimension_count", head_dim)), head_dim)
    if partial != 1.0:
        config["partial_rotary_factor"] = partial
    if arch == "phi3":
        # llama.cpp ignores a Phi-3 file's sliding window (it runs every layer over the whole
        # context), and so does transformers' GGUF reader: so do we.
        config["sliding_window"] = None
        original = get("rope.scaling.original_context_length", None)
        if original is not None:
            config["original_max_position_embeddings"] = int(original)
    if arch in _GEMMA_SWA_PATTERN:
        config.update(_gemma_config(path, arch, get, config))
    scaling = _rope_scaling(path, get, tensors, int(head_dim * partial))
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _partial_rotary(path: str, arch: str, rotary_dim: int, head_dim: int) -> float:
    """rope.dimension_count as a share of the head (Phi-3 rotates part of each head; the
    other architectures must rotate all of it)."""
    if rotary_dim == head_dim:
        return 1.0
    partial = rotary_dim / head_dim
    if arch != "phi3" or not 0 < rotary_dim < head_dim or int(head_dim * partial) != rotary_dim:
        raise ParameterError("model", f"GGUF file {path!r} rotates {rotary_dim} of {head_dim} head "
                             f"dimensions; only phi3 files may rotate part of each head")
    return partial


def _gemma_config(path: str, arch: str, get, config: dict) -> dict:
    """Gemma 2/3: GeGLU, the sliding-window layers, the score scale and the soft caps, with
    llama.cpp's defaults for what the file leaves out."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    out = {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": None}
    window = int(get("attention.sliding_window", 4096 if arch == "gemma2" else 0))
    if window > 0:
        pattern = get("attention.sliding_window_pattern", _GEMMA_SWA_PATTERN[arch])
        if isinstance(pattern, list):  # one flag per layer: windowed or not
            windowed = [bool(p) for p in pattern]
            if len(windowed) != layers:
                raise ParameterError("model", f"GGUF {arch}.attention.sliding_window_pattern of {path!r} has "
                                     f"{len(windowed)} entries for {layers} layers")
        else:  # every n-th layer global (n = 0: all windowed)
            n = int(pattern)
            windowed = [n == 0 or i % n < n - 1 for i in range(layers)]
        out.update(sliding_window=window,
                   layer_types=["sliding_attention" if w else "full_attention" for w in windowed])
    big = layers == _GEMMA_27B_LAYERS[arch]
    out["query_pre_attn_scalar"] = config["hidden_size"] // heads if big else config["head_dim"]
    local_theta = get("rope.freq_base_swa", None)
    if arch == "gemma2":
        if local_theta is not None and float(local_theta) != config["rope_theta"]:
            raise ParameterError("model", f"GGUF gemma2 file {path!r} has a sliding-window rope base "
                                 f"{local_theta} other than its rope base {config['rope_theta']}; not supported")
        out["attn_logit_softcapping"] = float(get("attn_logit_softcapping", 50.0))
        out["final_logit_softcapping"] = float(get("final_logit_softcapping", 30.0))
    else:
        out["rope_local_base_freq"] = float(10000.0 if local_theta is None else local_theta)
        out["final_logit_softcapping"] = float(get("final_logit_softcapping", 0.0)) or None
    return out


def _rope_scaling(path: str, get, tensors: dict, rotary_dim: int) -> dict | None:
    """Rotary scaling from the file: `rope.scaling.type` linear; Llama 3.x's `rope_freqs`
    tensor (what llama.cpp's converter writes for a llama3 rope: a divisor per frequency),
    applied as llama.cpp applies it: each inverse frequency divided by its factor; and Phi-3's
    LongRoPE, the `rope_factors_short` and `rope_factors_long` tensors."""
    kind = get("rope.scaling.type", "none")
    if kind not in ("none", "linear", LONGROPE):
        raise ParameterError("model", f"GGUF rope scaling {kind!r} of {path!r} is not supported; "
                             f"supported: ['linear', 'longrope', 'none'] and a rope_freqs tensor")
    freqs = tensors.get("rope_freqs.weight")
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if (long is None) != (short is None) or (kind == LONGROPE and long is None):
        raise ParameterError("model", f"GGUF file {path!r} must hold both rope_factors_long and "
                             f"rope_factors_short for LongRoPE, or neither")
    if long is not None:
        if kind == "linear" or freqs is not None:
            raise ParameterError("model", f"GGUF file {path!r} has LongRoPE factors and another rope scaling")
        scaling = {"rope_type": LONGROPE, "long_factor": _factors(path, long, rotary_dim),
                   "short_factor": _factors(path, short, rotary_dim)}
        attention = get("rope.scaling.attn_factor", None)
        if attention is not None:
            scaling["attention_factor"] = float(attention)
        return scaling
    if freqs is not None:
        if kind == "linear":
            raise ParameterError("model", f"GGUF file {path!r} has both linear rope scaling and rope_freqs")
        return {"rope_type": FREQ_FACTORS, "factors": _factors(path, freqs, rotary_dim)}
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    return None


def _factors(path: str, t, rotary_dim: int) -> tuple[float, ...]:
    """A rope factor tensor: F32, one value per rotary frequency (rotary_dim / 2)."""
    factors = np.asarray(t.data, dtype=np.float32).reshape(-1)
    if t.tensor_type.name != "F32" or factors.size != rotary_dim // 2:
        raise ParameterError("model", f"GGUF {t.name} of {path!r} must be F32 with rotary dim / 2 = "
                             f"{rotary_dim // 2} values, got {t.tensor_type.name} with {factors.size}")
    return tuple(float(f) for f in factors)


def gguf_eos_token_ids(path: str) -> list[int]:
    eos = metadata(path, "tokenizer.ggml.eos_token_id", None)
    return [] if eos is None else [int(eos)]


def hf_pretrained_args(model: str) -> tuple[str, dict]:
    """(path, kwargs) for transformers' `from_pretrained` on the same checkpoint: a GGUF file
    is named by its directory plus `gguf_file=`."""
    path = find_gguf(model)
    if path is None:
        return model, {}
    return os.path.dirname(os.path.abspath(path)), {"gguf_file": os.path.basename(path)}
